"""The README is a user's guide: short, free of run anecdotes, its links live, and its own-model
example (the class and its fleet.yaml) valid against the code as it is."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpubroker import InputError
from gpubroker.quotas.config import parse_config_text

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block(lang: str, first_line: str) -> str:
    blocks = re.findall(rf"```{lang}\n({re.escape(first_line)}.*?)```", README, re.S)
    assert len(blocks) == 1, f"README: expected one ```{lang} block starting {first_line!r}"
    return blocks[0]


def test_the_readme_is_short_and_keeps_the_two_setup_commands():
    assert len(README.encode()) <= 12_000, "README.md is over 12 KB: move detail to docs/"
    assert "make demo" in README and "make test" in README


def test_the_readme_holds_no_dates_times_or_commit_hashes():
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "a date: run histories go to bench/notes/"
    assert "UTC" not in README
    assert not re.search(r"\b(commit|at|on) `?[0-9a-f]{7,40}\b", README), "a commit hash"


def test_every_relative_link_names_a_file_of_the_repo():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), f"README links to {target}, which is not in the repo"


def test_the_own_model_example_validates_loads_and_answers_json():
    config = parse_config_text(_block("yaml", "# fleet.yaml"), "README fleet.yaml")
    spec = config.models["scorer"]
    namespace: dict = {}
    exec(compile(_block("python", "# acme/models.py"), "README acme/models.py", "exec"), namespace)
    model = namespace[spec.model.partition(":")[2]](**spec.options)
    model.load("cpu")
    item = model.validate(model.example_input())
    outputs = model.predict([item, {"x": [1, 1, 1, 1]}])
    assert len(outputs) == 2 and set(json.loads(json.dumps(outputs))[0]) == {"score", "label"}
    try:
        model.validate({"x": [1, 2]})
    except InputError as exc:
        assert exc.field == "x"
    else:
        raise AssertionError("the README's validate accepted a 2-number x")


def test_the_quickstart_config_is_the_demo_config_and_it_validates():
    assert "configs/demo.yaml" in README
    demo = parse_config_text((ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8"), "configs/demo.yaml")
    assert {"minilm", "cnn", "mlp", "prof"} == set(demo.models), "the README names these four models"
