"""The dflash engine on the real default model: greedy output with the ngram drafter is
token for token the model's own, and ``omlx-core serve --engine dflash`` serves it with
drafted and accepted tokens in the usage and in ``/metrics``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.dflash import DFlashEngine
from omlx_core.testing.host import make_test_host
from omlx_core.testing import engine_io
from omlx_core.testing.waiting import free_port, wait_for_output

pytestmark = pytest.mark.slow

PASSAGE = ("The memory guard refuses a request that can never fit before a single byte of "
           "the response is sent. A request that fits alone but not next to the running ones "
           "waits. A prefill chunk that would overshoot the ceiling is refused before the "
           "forward runs. Everything else is a plugin on a small core, so a third party can "
           "install an engine and it is picked up.")
MESSAGES = [{"role": "user", "content": "Repeat this text word for word:\n\n" + PASSAGE}]


def test_ngram_greedy_output_is_the_default_models_own(default_model_dir):
    engine = DFlashEngine(spec_for_path(default_model_dir), make_test_host(load_config("cpu-small", env={})))
    engine.start()
    try:
        prompt = engine.tokenize_chat(MESSAGES)

        def reference():
            model, tokenizer = load_model(default_model_dir)
            out = []
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=48,
                                          sampler=lambda logits: mx.argmax(logits, axis=-1)):
                if int(token) in tokenizer.eos_token_ids:
                    break
                out.append(int(token))
            return out

        expected = mlx_thread().run(reference)
        handle = engine.submit(GenerationRequest("copy", prompt, SamplingParams(
            temperature=0.0, max_tokens=48)))
        tokens, last = [], None
        for output in engine_io.collect(handle):
            tokens += output.token_ids
            last = output
        assert tokens == expected
        assert last.usage.accepted_draft_tokens > 0, "nothing copied from the prompt was accepted"
    finally:
        engine.shutdown()


def test_serve_engine_dflash_reports_drafted_and_accepted_tokens(default_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "omlx_core", "serve", "--tier", "cpu-small", "--port", str(port),
             "--engine", "dflash"],
            stdout=output, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        started = wait_for_output(process, log, f"ready: http://127.0.0.1:{port}", timeout=180)
        assert "starting engine 'dflash'" in started, started
        body = json.dumps({"model": "smollm2-135m-instruct", "messages": MESSAGES,
                           "max_tokens": 32, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            usage = json.loads(response.read())["usage"]
        speculative = usage["speculative"]
        assert speculative["drafted_tokens"] > 0
        assert 0 < speculative["accepted_tokens"] <= speculative["drafted_tokens"]
        assert speculative["acceptance_rate"] == pytest.approx(
            speculative["accepted_tokens"] / speculative["drafted_tokens"], abs=1e-4)
        assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == \
            speculative["accepted_tokens"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        for name in ("omlx_engine_speculative_drafted_tokens", "omlx_engine_speculative_accepted_tokens",
                     "omlx_engine_speculative_acceptance_rate"):
            assert name in metrics, name
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
