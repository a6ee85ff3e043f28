"""``port_free`` (the check before ``gpubroker up`` starts Ray): a listener holds the port; a connection of
the fleet just stopped, left in TIME-WAIT, does not (Serve's proxy binds with SO_REUSEADDR too)."""

from __future__ import annotations

import socket

from gpubroker.deployments.cluster.local_ray import port_free


def _time_wait_port() -> int:
    """A port whose listener (SO_REUSEADDR, as uvicorn's) is closed and whose server side closed a
    connection first (TIME-WAIT; the connection keeps the listener's SO_REUSEADDR)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server closes first: its end of the connection waits in TIME-WAIT on `port`
    client.close()
    listener.close()
    return port


def test_a_listener_holds_the_port():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert not port_free(s.getsockname()[1])


def test_a_time_wait_connection_does_not():
    port = _time_wait_port()
    with socket.socket() as plain:  # what the check did before: a bind without SO_REUSEADDR is refused
        try:
            plain.bind(("127.0.0.1", port))
            refused_without_reuse = False
        except OSError:
            refused_without_reuse = True
    assert refused_without_reuse, "the TIME-WAIT set-up did not hold the port (nothing to test)"
    assert port_free(port)
