"""The attacks of issue 21 on a real server (`deeppool serve`, uvicorn): each is now a 4xx with a reason, or refused.

Oversized bodies get 413 unread; a 422 never echoes its input; the 500s (a link loop, a NUL byte, a name too
long, a lone surrogate, a non-finite amplification, a log offset past the end) are 4xx; a reused idempotency
key with another body is a 409 naming the difference; a factory's inputs are taken; the page names no owner;
`deeppool logs` reassembles a log exactly.
"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.coordinator.test_durability import start, token
from tests.entry import deeppool
from tests.net import free_port

pytestmark = pytest.mark.slow
FACTORY = {"kind": "bg", "model": "examples.mlp:model", "batch": 8, "input_shape": [16]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("limits")
    models = folder / "models"
    models.mkdir()
    (models / "loop.py").symlink_to(models / "loop.py")
    db, port = folder / "deeppool.db", free_port()
    secret = token(db)
    proc = start(db, port, allow=(models,), paused=True, logs=folder / "logs", job_user=False)  # paused: no job runs
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {secret}"},
                        timeout=30)
    yield http, port, folder, secret
    http.close()
    proc.terminate()
    proc.wait(10)


def raw(port: int, head: bytes, body: bytes = b"", chunk: int = 1 << 16) -> bytes:
    """Send ``head`` then ``body`` (from a thread, as a client that does not wait); the server's first answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head)

        def send() -> None:
            try:
                for at in range(0, len(body), chunk):
                    conn.sendall(body[at:at + chunk])
            except OSError:
                pass  # the server answered and closed: the rest is never read

        sender = threading.Thread(target=send)
        sender.start()
        answer = b""
        while not answer.endswith(b"}"):  # the JSON answer, whole
            part = conn.recv(65536)
            if not part:
                break
            answer += part
        sender.join()
        return answer


def test_an_oversized_body_gets_413_before_it_is_read(server) -> None:
    _, port, _, _ = server
    declared = raw(port, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 209715200\r\n\r\n")  # 200 MB declared, none sent, no token
    assert declared.startswith(b"HTTP/1.1 413") and b"limit of 1048576 bytes" in declared
    chunks = b"".join(b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16)) for _ in range(40))  # 2.5 MiB, no length
    streamed = raw(port, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n", chunks)
    assert streamed.startswith(b"HTTP/1.1 413") and b"limit of 1048576 bytes" in streamed


def test_a_chunked_body_over_the_limit_is_cut_and_its_connection_closed(server) -> None:
    """Issue 44, failure 9: a 200 MiB chunked body got its 413 after 1 MiB, but the server read all of it."""
    _, port, _, _ = server
    piece = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        closed = False
        try:
            while sent < 200 << 20:  # 200 MiB, unless the server closes first
                conn.sendall(piece)
                sent += len(piece)
        except OSError:
            closed = True
        try:
            while part := conn.recv(65536):
                answer += part
        except OSError:
            pass
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()
    assert closed and sent < 32 << 20, f"{sent} bytes went in before the server closed"  # buffers, not the body


def test_a_422_names_where_and_what_but_never_echoes_the_input(server) -> None:
    http, _, _, _ = server
    junk = "A" * 500_000
    refused = http.post("/v1/jobs", json={**FACTORY, "kind": junk, "surprise": junk})
    assert refused.status_code == 422 and len(refused.content) < 2000 and junk[:100] not in refused.text
    assert {tuple(p["loc"]) for p in refused.json()["detail"]} == {("body", "kind"), ("body", "surprise")}


@pytest.mark.parametrize("body, code, says", [
    (b'{"kind": "bg", "model": "MODELS/loop.py", "batch": 8}', 422, "symbolic link loop"),
    (b'{"kind": "bg", "model": "MODELS/a\\u0000.py", "batch": 8}', 422, "NUL"),
    (b'{"kind": "bg", "model": "MODELS/' + b"x" * 300 + b'.py", "batch": 8}', 422, "File name too long"),
    (b'{"kind": "bg", "model": "MODELS/\\ud800.py", "batch": 8}', 422, "unicode"),
    (b'{"kind": "bg", "model": "a.b:c", "input_shape": [4], "batch": 8, "amplification": NaN}', 422, "finite"),
    (b'{"kind": "bg", "model": "a.b:c", "input_shape": [4], "batch": 8, "amplification": -Infinity}', 422, "finite"),
    (b'{"kind": "bg", "model": "a.b:c", "input_shape": [4], "batch": 8, "amplification": Infinity}', 422, "finite"),
    (b'{"kind": "bg", "model": "a.b:c", "batch": 8}', 422, "give its per-sample input_shape"),
    (b'{"kind": "bg", "model": "a.b:c", "input_shape": [4], "input_dtype": "int64", "batch": 8}', 422, "vocab_size"),
])
def test_what_gave_500s_is_a_4xx_with_a_reason(server, body: bytes, code: int, says: str) -> None:
    http, _, folder, _ = server
    response = http.post("/v1/jobs", content=body.replace(b"MODELS", str(folder / "models").encode()),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == code, response.text
    detail = response.json()["detail"]
    text = detail if isinstance(detail, str) else "; ".join(p["msg"] for p in detail)
    assert says in text and "\n" not in text


def test_a_log_offset_past_the_end_is_416(server) -> None:
    http, _, _, _ = server
    job = http.post("/v1/jobs", json=FACTORY).json()
    far = http.get(f"/v1/jobs/{job['id']}/logs", params={"offset": 17592186044415})
    assert far.status_code == 416 and "past the end" in far.json()["detail"]


def test_an_idempotency_key_reused_with_another_body_is_409_naming_the_difference(server) -> None:
    http, _, _, _ = server
    first = http.post("/v1/jobs", json={**FACTORY, "idempotency_key": "k-409"})
    same = http.post("/v1/jobs", json={**FACTORY, "idempotency_key": "k-409"})
    other = http.post("/v1/jobs", json={**FACTORY, "batch": 16, "idempotency_key": "k-409"})
    assert first.status_code == 201 and same.status_code == 200 and same.json()["id"] == first.json()["id"]
    assert other.status_code == 409
    assert "batch: '8' there, '16' here" in other.json()["detail"] and f"job {first.json()['id']}" in other.json()[
        "detail"]


def test_a_factory_model_takes_its_inputs(server) -> None:
    http, _, _, _ = server
    job = http.post("/v1/jobs", json={"kind": "fg", "model": "transformers_gpt:model", "batch": 8, "gpus": 1,
                                      "input_shape": [32], "input_dtype": "int64", "vocab_size": 50257}).json()
    assert (job["input_shape"], job["input_dtype"], job["vocab_size"]) == ([32], "int64", 50257)


def test_the_page_shows_no_owner(server) -> None:
    http, _, _, _ = server
    job = http.post("/v1/jobs", json=FACTORY).json()
    assert http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    page = httpx.get(f"{http.base_url}/").text
    assert "cancelled by its owner" in page and "alice" not in page


def test_deeppool_logs_reassembles_a_log_exactly(server, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    http, port, folder, secret = server
    job = http.post("/v1/jobs", json=FACTORY).json()
    text = "".join(f"{n} é € 𝄞 ü\n" for n in range(200_000))  # 3.4 MB: 1 MiB chunks fall inside characters
    (folder / "logs" / f"job-{job['id']}.log").write_text(text)
    monkeypatch.setenv("DEEPPOOL_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("DEEPPOOL_TOKEN", secret)
    printed = deeppool(capsys, "logs", str(job["id"]))
    assert printed.code == 0 and printed.stdout == text  # every chunk, no U+FFFD
