"""Model adapters: outputs, validation naming the field, batch invariance, resolution, calibration."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")

from gpubroker.deployments.models import (  # noqa: E402
    BUILTINS,
    EmulatedOOM,
    InputError,
    ModelAdapter,
    ModelRefError,
    is_oom,
    load_adapter,
    resolve_model,
)
from gpubroker.deployments.replica.calibration import calibrate, fit_line  # noqa: E402

FIXTURE = "tests.unit.user_model_fixture"


def assert_batch_invariant(adapter, items, key):
    """Each item alone vs inside the whole (mixed) batch and a reversed batch: allclose 1e-5."""
    alone = [adapter.predict([item])[0][key] for item in items]
    together = [out[key] for out in adapter.predict(items)]
    reversed_ = [out[key] for out in adapter.predict(items[::-1])][::-1]
    for a, b, c in zip(alone, together, reversed_):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
        assert torch.allclose(torch.tensor(a), torch.tensor(c), atol=1e-5)


def field_of(exc_info) -> str:
    return exc_info.value.field


# ---------------------------------------------------------------------------------------------
# minilm


@pytest.fixture(scope="module")
def minilm():
    return load_adapter("minilm", {}, "cpu")


def test_minilm_embedding_is_384_and_unit_norm(minilm):
    outs = minilm.predict([minilm.validate({"text": "A cat sits on the mat."}), {"text": ""}])
    assert len(outs) == 2
    for out in outs:
        emb = out["embedding"]
        assert len(emb) == 384
        assert math.isclose(math.sqrt(sum(v * v for v in emb)), 1.0, rel_tol=1e-5)
    json.dumps(outs)


def test_minilm_is_semantic(minilm):
    a, b, c = (
        torch.tensor(o["embedding"])
        for o in minilm.predict(
            [
                {"text": "a dog runs in the park"},
                {"text": "a puppy is running in a park"},
                {"text": "quarterly tax filing deadline"},
            ]
        )
    )
    assert float(a @ b) > float(a @ c) + 0.2


def test_minilm_cost_counts_tokens_with_specials(minilm):
    assert minilm.cost_unit == "tokens"
    assert minilm.cost({"text": ""}) == 2  # [CLS] [SEP]
    assert minilm.cost({"text": "hello world"}) == 4
    for n in (2, 10, 100):
        assert minilm.cost(minilm.example_input(n)) == n


def test_minilm_cost_of_a_validated_item_does_not_tokenize_again(minilm, monkeypatch):
    """The replica validates an item, then asks its cost: one tokenization, the same count; any
    other text (another request's, counted in between) is counted afresh."""
    calls = []
    count = minilm.token_count
    monkeypatch.setattr(minilm, "token_count", lambda text: calls.append(text) or count(text))
    a = minilm.validate({"text": "share one card between models"})
    assert minilm.cost(a) == count(a["text"]) and len(calls) == 1
    b = minilm.validate({"text": "another request"})
    assert minilm.cost(a) == count(a["text"])  # validate(b) came in between: counted again
    assert minilm.cost(b) == count(b["text"])
    assert calls == [a["text"], b["text"], a["text"]]
    equal = "".join(["share one card ", "between models"])  # equal to a's text, not the string validate saw
    assert equal is not a["text"] and minilm.cost({"text": equal}) == minilm.cost(a)


def test_minilm_refuses_long_text_naming_the_field(minilm):
    with pytest.raises(InputError) as err:
        minilm.validate({"text": "word " * 300})
    assert field_of(err) == "text"
    assert "256" in err.value.message and "max_tokens" in err.value.message
    small = load_adapter("minilm", {"max_tokens": 8})
    small.validate(small.example_input(8))
    with pytest.raises(InputError):
        small.validate({"text": "hello " * 7})  # 9 tokens


@pytest.mark.parametrize(
    "item, field",
    [({"text": 3}, "text"), ({}, "text"), ({"text": "x", "extra": 1}, "extra"), ("just a string", "body")],
)
def test_minilm_validation_names_field(minilm, item, field):
    with pytest.raises(InputError) as err:
        minilm.validate(item)
    assert field_of(err) == field
    assert isinstance(err.value, ValueError)


def test_minilm_batch_invariance_short_and_long(minilm):
    items = [
        {"text": "hi"},
        {"text": " ".join(f"token{i}" for i in range(60))},
        {"text": "A medium length sentence about GPUs sharing memory."},
        {"text": ""},
        {"text": "long " * 120},
    ]
    assert_batch_invariant(minilm, items, "embedding")


def test_minilm_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    from gpubroker.deployments.models.minilm import default_model_path

    ref = st.SentenceTransformer(default_model_path(), device="cpu")  # needs str, not Path
    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    want = ref.encode(texts, convert_to_tensor=True)
    got = torch.tensor([o["embedding"] for o in minilm.predict([{"text": t} for t in texts])])
    assert torch.allclose(got, want.cpu(), atol=1e-5)


def test_minilm_validation_is_safe_beside_a_running_batch(minilm):
    """The replica validates new requests in a worker thread while a batch runs in another."""
    import threading

    texts = [{"text": " ".join(["token"] * n)} for n in (3, 40, 120, 7)] * 8
    errors: list[BaseException] = []

    def validate_loop():
        try:
            for item in texts * 3:
                minilm.cost(minilm.validate(item))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=validate_loop) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(3):
        out = minilm.predict(texts)
        assert len(out) == len(texts)
    for t in threads:
        t.join()
    assert not errors, errors


def test_minilm_calibration_is_fast(minilm):
    cal = calibrate(minilm)
    assert cal.seconds < 5
    assert cal.unit == "tokens" and cal.method == "hooks"
    assert cal.bytes_per_unit > 0
    assert abs(cal.weights_bytes - minilm.weights_bytes()) / minilm.weights_bytes() < 0.05


# ---------------------------------------------------------------------------------------------
# mlp


@pytest.fixture(scope="module")
def mlp():
    return load_adapter("mlp", {}, "cpu")


def test_mlp_logits_shape(mlp):
    outs = mlp.predict([mlp.validate(mlp.example_input()), {"x": [0.0] * 64}])
    assert [len(o["logits"]) for o in outs] == [10, 10]
    json.dumps(outs)


def test_mlp_replicas_agree(mlp):
    other = load_adapter("mlp", {})
    item = mlp.example_input()
    assert mlp.predict([item]) == other.predict([item])
    different = load_adapter("mlp", {"seed": 1})
    assert different.predict([item]) != mlp.predict([item])


def test_mlp_options():
    adapter = load_adapter("mlp", {"in_dim": 8, "hidden": 4, "out_dim": 3})
    assert len(adapter.predict([{"x": [1.0] * 8}])[0]["logits"]) == 3
    with pytest.raises(TypeError, match="hiden"):
        resolve_model("mlp")(hiden=3)
    with pytest.raises(ValueError, match="hidden"):
        resolve_model("mlp")(hidden=0)


@pytest.mark.parametrize(
    "item, field, text",
    [
        ({"x": [0.0] * 63}, "x", "expected shape [64], got [63]"),
        ({"x": [0.0] * 63 + ["a"]}, "x", "x[63]"),
        ({"x": [True] + [0.0] * 63}, "x", "x[0]"),
        ({"x": [float("nan")] * 64}, "x", "finite"),
        ({"x": "nope"}, "x", "list"),
        ({"y": [0.0] * 64}, "x", "missing"),
    ],
)
def test_mlp_validation_names_field(mlp, item, field, text):
    with pytest.raises(InputError) as err:
        mlp.validate(item)
    assert field_of(err) == field
    assert text in str(err.value)


def test_mlp_batch_invariance(mlp):
    items = [{"x": [math.sin(i * k) for i in range(64)]} for k in range(1, 12)]
    assert_batch_invariant(mlp, items, "logits")


def test_mlp_calibration_weights_close_to_parameter_bytes(mlp):
    params = sum(p.numel() * p.element_size() for p in mlp.module.parameters())
    cal = calibrate(mlp)
    assert abs(cal.weights_bytes - params) <= 0.05 * params
    assert cal.bytes_per_unit > 0
    assert [x for x, _ in cal.points] == [1, 2, 4, 8]
    json.dumps(cal.to_dict())


# ---------------------------------------------------------------------------------------------
# cnn


@pytest.fixture(scope="module")
def cnn():
    return load_adapter("cnn", {}, "cpu")


def image(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, 32, 32, generator=g).tolist()


def test_cnn_logits_shape(cnn):
    outs = cnn.predict([cnn.validate({"image": image(0)}), cnn.validate(cnn.example_input())])
    assert [len(o["logits"]) for o in outs] == [10, 10]
    json.dumps(outs)


@pytest.mark.parametrize(
    "value, text",
    [
        ([[0.0] * 32] * 3, "image: expected shape [3, 32, 32], got [3, 32]"),
        ([[[0.0] * 32] * 32] * 4, "expected shape [3, 32, 32], got [4, 32, 32]"),
        ([[[0.0] * 32] * 32] * 2 + [[[0.0] * 32] * 31], "image[2] should hold 32 values, got 31"),
        ([[[0.0] * 32] * 32] * 2 + [[[0.0] * 32] * 31 + [[0.0] * 31]], "image[2][31] should hold 32 values, got 31"),
        ([[["a"] * 32] * 32] * 3, "expected a number at image[0][0][0], got str"),
        ("pixels", "expected shape [3, 32, 32], got a str"),
    ],
)
def test_cnn_validation_names_field(cnn, value, text):
    with pytest.raises(InputError) as err:
        cnn.validate({"image": value})
    assert field_of(err) == "image"
    assert text in str(err.value)


def test_cnn_batch_invariance(cnn):
    items = [cnn.validate({"image": image(s)}) for s in range(6)]
    assert_batch_invariant(cnn, items, "logits")


# ---------------------------------------------------------------------------------------------
# profiled (emulation)


def test_profiled_latency_and_output():
    adapter = load_adapter("profiled", {"a_ms": 20, "c_ms": 5})
    started = time.perf_counter()
    outs = adapter.predict([adapter.validate({})] * 4)
    took_ms = (time.perf_counter() - started) * 1000
    assert outs == [{"ok": True, "batch": 4, "cost": 4}] * 4
    assert 40 <= took_ms < 200


def test_profiled_tokens_unit_and_memory():
    adapter = load_adapter(
        "profiled", {"a_ms": 0, "c_ms": 0, "unit": "tokens", "weights_bytes": 1000, "bytes_per_item": 10}
    )
    assert adapter.cost_unit == "tokens"
    assert adapter.cost(adapter.validate({"tokens": 7})) == 7
    assert adapter.weights_bytes() == 1000
    adapter.set_memory_limit(1100)  # recorded only: the replica's OS limit refuses it (tests/unit/test_enforce.py)
    assert adapter.predict([{"tokens": 5}, {"tokens": 5}])[0]["cost"] == 10
    assert adapter.predict([{"tokens": 6}, {"tokens": 5}])[0]["cost"] == 11
    adapter.set_memory_limit(None)
    adapter.predict([{"tokens": 600}])
    cal = calibrate(adapter)
    assert (cal.weights_bytes, cal.bytes_per_unit, cal.method) == (1000, 10.0, "declared")


@pytest.mark.parametrize("item, field", [({"tokens": 0}, "tokens"), ({"tokens": "3"}, "tokens"), ({"t": 1}, "t")])
def test_profiled_validation_names_field(item, field):
    with pytest.raises(InputError) as err:
        load_adapter("profiled").validate(item)
    assert field_of(err) == field


def test_profiled_bad_option():
    with pytest.raises(ValueError, match="unit"):
        load_adapter("profiled", {"unit": "bytes"})


# ---------------------------------------------------------------------------------------------
# resolution, user models, errors


def test_builtins_resolve_to_adapters():
    for name in BUILTINS:
        cls = resolve_model(name)
        assert issubclass(cls, ModelAdapter) and cls.name == name


def test_duck_typed_user_model_gets_defaults():
    cls = resolve_model(f"{FIXTURE}:EchoModel")
    assert issubclass(cls, ModelAdapter)
    adapter = load_adapter(f"{FIXTURE}:EchoModel", {"scale": 2.0})
    assert adapter.cost_unit == "requests"
    item = adapter.validate({"x": 3})
    assert adapter.cost(item) == 1
    assert adapter.predict([item, {"x": 1}]) == [{"y": 6.0}, {"y": 2.0}]
    adapter.set_memory_limit(10)
    assert adapter.weights_bytes() == 0
    with pytest.raises(NotImplementedError):
        adapter.example_input()
    assert calibrate(adapter).method == "none"
    with pytest.raises(TypeError, match="bogus"):
        load_adapter(f"{FIXTURE}:EchoModel", {"bogus": 1})


def test_duck_typed_user_model_optional_methods():
    adapter = load_adapter(f"{FIXTURE}:TokenModel", {}, "cpu")
    assert adapter.inner.device == "cpu"
    assert adapter.cost_unit == "tokens"
    with pytest.raises(InputError) as err:
        adapter.validate({"words": "no"})
    assert field_of(err) == "words"
    assert adapter.cost(adapter.example_input(3)) == 3
    assert adapter.predict([{"words": ["a"]}, {"words": []}]) == [1, 0]


def test_user_subclass_is_returned_as_is():
    cls = resolve_model(f"{FIXTURE}:SubclassModel")
    assert cls.__name__ == "SubclassModel"
    assert load_adapter(f"{FIXTURE}:SubclassModel", {"bias": 2.5}).predict([{}, {}]) == [2.5, 2.5]


@pytest.mark.parametrize(
    "ref, text",
    [
        ("no_such_pkg.models:Thing", "module 'no_such_pkg.models' not found"),
        (f"{FIXTURE}:Missing", "no class 'Missing'"),
        (f"{FIXTURE}:NoPredict", "has no predict(items) method"),
        (f"{FIXTURE}:not_a_class", "not a class"),
        ("bert", "neither a built-in"),
    ],
)
def test_resolve_errors_are_clear(ref, text):
    with pytest.raises(ModelRefError, match=None) as err:
        resolve_model(ref)
    assert text in str(err.value)


def test_is_oom():
    assert is_oom(EmulatedOOM("x")) and is_oom(MemoryError())
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_oom(ValueError("x")) and not is_oom(RuntimeError("shape mismatch"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert is_oom(OSError(12, "Cannot allocate memory")) and not is_oom(OSError(2, "No such file"))


def test_fit_line_clamps():
    assert fit_line([(1, 10), (2, 20), (4, 40)]) == pytest.approx((0.0, 10.0))
    assert fit_line([(1, 5), (2, 4)]) == pytest.approx((4.5, 0.0))  # negative slope -> flat
    assert fit_line([(1, 1), (2, 9)])[0] == 0.0  # negative intercept -> through the origin
    assert fit_line([]) == (0.0, 0.0)


def test_models_package_import_is_light():
    import subprocess
    import sys

    code = "import sys, gpubroker.deployments.models, gpubroker.deployments.replica.oom; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# Ordinary PyTorch code: async predict, weights under any attribute name, the public protocol.


def test_async_predict_and_load_run():
    adapter = load_adapter(f"{FIXTURE}:AsyncModel", {}, "cpu")
    assert adapter.predict([{"x": 1}, {"x": 2}]) == [{"y": 2, "loaded": True}, {"y": 3, "loaded": True}]
    assert adapter.predict([{"x": 5}]) == [{"y": 6, "loaded": True}]  # the adapter's loop runs again


def test_weights_count_whatever_the_attribute_is_called():
    adapter = load_adapter(f"{FIXTURE}:EncoderModel", {}, "cpu")
    assert adapter.weights_bytes() == (64 * 32 + 32 + 32 * 2 + 2) * 4
    assert adapter.torch_module() is not None
    outs = adapter.predict([{}, {}])
    assert len(outs) == 2 and tuple(outs[0].shape) == (2,)  # tensors: the HTTP layer makes them JSON


def test_a_subclass_of_the_public_model_protocol_inherits_the_defaults():
    from tests.unit.user_model_fixture import protocol_subclass

    cls = protocol_subclass()
    model = cls(k=3)
    assert model.predict([1, 2]) == [3, 6] and model.validate({"a": 1}) == {"a": 1} and model.cost("x") == 1
    with pytest.raises(NotImplementedError):
        model.example_input()
    import gpubroker

    assert gpubroker.InputError is InputError and gpubroker.__version__
