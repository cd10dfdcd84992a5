"""Peak resident memory under ``--memory-ceiling`` (issue 24, item 5).

A real ``omlx-core serve --memory-ceiling 0.9GiB`` on the default model takes the
goodput mix of ``omlx_core.bench.ceiling`` (10 concurrent streaming chats: short and
medium prompts, two long answers; its two 1.8k-token prompts left out) twice, each
time on a fresh process over the same SSD-cache directory: the first fills the SSD
tier, the second is served from it (the case that went furthest over). Resident memory is sampled from outside about
50 times a second (VmRSS), and the kernel's own high-water mark (VmHWM, start-up
included) is read at the end; every sample and the mark must be at or under the
ceiling, and every chat must complete. ``docs/reliability.md`` has the measurements.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_core.bench.ceiling import _prompts
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.servers import ServerProcess
from omlx_core.bench.soak import Sampler, read_status, server_spec
from omlx_core.settings import parse_size
from omlx_core.testing.waiting import free_port

pytestmark = pytest.mark.slow

CEILING = "0.9GiB"
MODEL = "smollm2-135m-instruct"


def goodput_mix_peak(model_dir: Path, ssd_dir: Path) -> tuple[int, int, list[bool], str]:
    """Peak sampled VmRSS, VmHWM, which chats completed, the server's log tail."""
    # The mix without its two 1.8k-token prompts: the measurements in the docs were taken
    # so, and it keeps the test to a few minutes on two cores.
    jobs = [job for job in _prompts(model_dir) if job[0] != "long"]
    banned = special_token_ids(model_dir)
    port = free_port()
    spec = server_spec(port, CEILING)
    # What is measured is memory, not speed: on a loaded machine a long prompt may wait
    # longer for memory than the default queue timeout allows.
    spec = type(spec)(spec.name, spec.label, spec.argv + [
        "--set", "memory.queue_timeout_s=1800", "--set", f"plugin.ssd_cache.dir={ssd_dir}"],
        spec.model_id)
    with ServerProcess(spec, port) as server:

        def one(index: int) -> bool:
            _, messages, max_tokens = jobs[index]
            return stream_chat(server.host, port, chat_body(MODEL, messages, max_tokens, banned),
                               timeout=1800).complete

        with Sampler(server.pid) as sampler:
            completed, _ = run_concurrently(len(jobs), one)
        end = read_status(server.pid)
        log = server.log_tail(60)
    return max(s.rss for s in sampler.samples), end.hwm, completed, log


@pytest.mark.xfail(reason="open: with the SSD tier warm the server's peak under the goodput "
                          "mix still passes a 0.9 GiB ceiling in some runs (900-961 MiB measured, "
                          "994 MiB before block loads stopped copying through the heap); see "
                          "docs/reliability.md, 'Peak RSS under the ceiling'", strict=False)
def test_peak_rss_stays_under_the_ceiling_under_the_goodput_mix(default_model_dir,
                                                                  tmp_path) -> None:
    ceiling = parse_size(CEILING)
    for run in ("cold SSD tier", "warm SSD tier"):
        peak, hwm, completed, log = goodput_mix_peak(default_model_dir, tmp_path / "ssd")
        assert all(completed), f"{run}: {log}"
        assert peak <= ceiling, (f"{run}: VmRSS reached {peak / 2**20:.1f} MiB, over the "
                                 f"{ceiling / 2**20:.1f} MiB ceiling")
        assert hwm <= ceiling, (f"{run}: VmHWM reached {hwm / 2**20:.1f} MiB, over the "
                                f"{ceiling / 2**20:.1f} MiB ceiling")
