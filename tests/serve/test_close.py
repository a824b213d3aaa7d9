"""Nothing is left after the endpoint: a session closed with calls in flight returns in
time and fails them (no client hangs), the port then refuses connections, ``close()``
is idempotent and ``serve()`` starts a new endpoint; a kernel restart and a SIGKILL of a
process that serves leave its port closed."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import rlnb
from tests.helpers import wait_until
from tests.helpers.kernel import OpenKernel, ok, stop_gracefully
from tests.helpers.processes import PythonProcesses
from tests.serve.helpers import DEADLINE, chat, config, raw, refuses_connections, slow_engine

pytestmark = [pytest.mark.netns]


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="client") as p:
        yield p


@pytest.mark.slow
def test_closing_the_session_fails_the_calls_in_flight_and_closes_the_port(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    with rlnb.Session(config(), name="closing", engine=slow_engine(long=2000)) as sess:  # 20 s a call
        ep = sess.serve()

        def call() -> Any:
            with ep.client(sync=True, max_retries=0, timeout=DEADLINE) as client:
                return client.chat.completions.create(model="m", messages=chat(), max_tokens=3000)

        calls = [pool.submit(call) for _ in range(3)]
        wait_until(lambda: sess.statistics().engine.running == 3, "three calls to generate")
        start = time.monotonic()
        sess.close()
        took = time.monotonic() - start
        print(f"\nclose with 3 calls in flight: {took:.2f} s")
        assert took < 7.0, f"close took {took:.1f} s with calls in flight"
        for future in calls:
            error = future.exception(timeout=5.0)  # an error, not a hang (nor a reply)
            assert isinstance(error, openai.InternalServerError), error
            assert error.status_code == 503 and "closing" in error.message
        assert ep.closed and refuses_connections(ep.port)
        with pytest.raises(rlnb.StateError, match=r"sess\.serve\(\) starts it again"):
            ep.client()


@pytest.mark.slow
def test_closing_with_clients_stuck_mid_request_returns_in_time() -> None:
    with rlnb.Session(config(), name="stuck") as sess:
        ep = sess.serve()
        key = ep.api_key.encode()
        with (
            socket.create_connection(("127.0.0.1", ep.port)) as half_body,
            socket.create_connection(("127.0.0.1", ep.port)) as half_headers,
        ):
            half_body.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                b"Authorization: Bearer " + key + b'\r\n\r\n{"model'
            )
            half_headers.sendall(b"POST /v1/compl")
            wait_until(lambda: ep.statistics().requests == 1, "the half-sent body to be read")
            start = time.monotonic()
            sess.close()
            took = time.monotonic() - start
            assert took < 7.0, f"close took {took:.1f} s with clients stuck mid-request"
            print(f"\nclose with clients stuck mid-request: {took:.2f} s")
            assert refuses_connections(ep.port)
            half_body.settimeout(5.0)
            assert half_body.recv(1000).startswith(b"HTTP/1.1 503 ")  # told, not left waiting
            half_headers.settimeout(5.0)
            assert half_headers.recv(1000) == b""  # dropped


def test_close_is_idempotent_and_serve_starts_a_new_endpoint() -> None:
    with rlnb.Session(config(), name="again") as sess:
        first = sess.serve()
        assert sess.serve() is first
        with pytest.raises(rlnb.StateError, match="close it first"):
            sess.serve(max_concurrency=3)
        old_port = first.port
        first.close()
        first.close()
        assert first.closed and refuses_connections(old_port)
        second = sess.serve()
        assert second is not first and second.port != old_port and second.api_key != first.api_key
        with second.client(sync=True, max_retries=0, timeout=DEADLINE) as client:
            assert client.chat.completions.create(model="m", messages=chat(), max_tokens=2).choices
        assert raw(second, "GET", "/v1/models", key=first.api_key).status_code == 401  # the old key is gone
    assert refuses_connections(second.port)


CHILD = """
import sys, threading, rlnb
sess = rlnb.Session(rlnb.Config(task="reverse"), name="child")
ep = sess.serve()
print(ep.port, ep.api_key, flush=True)
threading.Event().wait()
"""


@pytest.mark.slow
def test_a_sigkill_of_a_process_that_serves_leaves_its_port_closed(start_python: PythonProcesses) -> None:
    proc = start_python("-c", CHILD)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    port, key = line.split()
    reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert reply.status_code == 200
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert refuses_connections(int(port))


KERNEL = """
import logging, rlnb
handler = logging.FileHandler({log!r})
handler.setFormatter(logging.Formatter("%(created).6f %(levelname)s %(message)s"))
logging.getLogger("rlnb").addHandler(handler)
logging.getLogger("rlnb").setLevel(logging.INFO)
sess = rlnb.Session(rlnb.Config(task="reverse"), name="k")
ep = sess.serve()
with ep.client(sync=True) as client:
    assert client.chat.completions.create(model="m", messages=[{{"role": "user", "content": "ab"}}], max_tokens=2)
print(ep.port, ep.api_key)
"""


@pytest.mark.slow
def test_a_kernel_restart_with_a_serving_session_leaves_nothing(tmp_path: Path, open_kernel: OpenKernel) -> None:
    log_file = tmp_path / "rlnb.log"
    with open_kernel() as (km, kc):
        port, key = ok(kc, KERNEL.format(log=str(log_file))).split()
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=10).status_code == 200
        stop_gracefully(km, log_file, restart=True)  # rlnb's hook closed session 'k' and the kernel exited itself
        assert refuses_connections(int(port))
        wait_until(lambda: km.is_alive(), "the new kernel")
