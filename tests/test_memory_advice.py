"""The advice ladder: each binding ceiling gets the knob that moves it, and third-party
plugins can add advice or replace it."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from omlx_core.hookspecs import hookimpl
from omlx_core.memory.types import CeilingBreakdown, Rejection
from omlx_core.pluginmanager import PluginManager
from omlx_core.plugins import advice as advice_plugin

GIB = 1024**3
MIB = 1024**2


@pytest.fixture
def plugins() -> PluginManager:
    manager = PluginManager()
    manager.register(advice_plugin, "advice")
    return manager


def rejection(breakdown: CeilingBreakdown | None, needed: int = 30 * GIB,
              stage: str = "preflight") -> Rejection:
    base = 20 * GIB
    return Rejection(estimated_bytes=needed - base, limit_bytes=breakdown.hard if breakdown else None,
                     breakdown=breakdown, prompt_tokens=110_000, stage=stage, base_bytes=base)


def advise(plugins: PluginManager, r: Rejection) -> list[str]:
    return plugins.hook.on_rejection(rejection=r)


def test_dynamic_binding_says_close_other_apps_with_static_cap_and_reclaimable(plugins):
    b = CeilingBreakdown(static=40 * GIB, dynamic=int(36.7 * GIB), tier="balanced",
                         total_ram=48 * GIB, reclaimable=12 * GIB, own_footprint=int(31.2 * GIB))
    [text] = advise(plugins, rejection(b))
    assert "Close other applications" in text
    assert "40.00 GiB" in text and "12.00 GiB" in text  # the static cap and what is free now
    assert "custom" not in text


def test_dynamic_binding_under_tier_custom_says_the_pinned_ceiling_does_not_help(plugins):
    b = CeilingBreakdown(static=48 * GIB, dynamic=26 * GIB, custom=44 * GIB, tier="custom",
                         total_ram=48 * GIB, reclaimable=6 * GIB, own_footprint=20 * GIB)
    [text] = advise(plugins, rejection(b))
    assert "custom ceiling (44.00 GiB)" in text
    assert "Raising the custom ceiling cannot help" in text and "close other applications" in text


def test_custom_binding_says_raise_the_custom_ceiling_with_a_number(plugins):
    b = CeilingBreakdown(static=40 * GIB, dynamic=36 * GIB, custom=24 * GIB, tier="custom",
                         total_ram=48 * GIB, reclaimable=20 * GIB)
    [text] = advise(plugins, rejection(b, needed=30 * GIB))
    assert "memory.custom_ceiling" in text and "--memory-ceiling" in text
    assert "33.00 GiB" in text and "--memory-ceiling 33GiB" in text  # 30 GiB + 10 %
    assert "allow up to 36.00 GiB" in text


def test_custom_binding_when_nothing_could_hold_it(plugins):
    b = CeilingBreakdown(static=20 * GIB, dynamic=18 * GIB, custom=10 * GIB, tier="custom")
    [text] = advise(plugins, rejection(b, needed=30 * GIB))
    assert "allow only 18.00 GiB" in text and "shorten the prompt" in text


def test_metal_device_binding_gives_a_sysctl_command_with_a_number(plugins):
    b = CeilingBreakdown(static=96 * GIB, dynamic=100 * GIB, device=24 * GIB,
                         device_kind="metal", tier="aggressive", total_ram=128 * GIB)
    [text] = advise(plugins, rejection(b, needed=30 * GIB))
    command = re.search(r"sudo sysctl iogpu\.wired_limit_mb=(\d+)", text)
    assert command, text
    assert int(command.group(1)) * MIB >= 30 * GIB  # enough for this request
    assert int(command.group(1)) * MIB < 128 * GIB - 4 * GIB  # and leaves macOS room


def test_metal_device_binding_beyond_what_the_mac_has_says_pick_a_smaller_model(plugins):
    b = CeilingBreakdown(static=12 * GIB, dynamic=12 * GIB, device=10 * GIB, device_kind="metal",
                         tier="aggressive", total_ram=16 * GIB)
    [text] = advise(plugins, rejection(b, needed=30 * GIB))
    assert "sysctl" not in text and "smaller model" in text


def test_cgroup_device_binding_says_raise_the_container_limit(plugins):
    b = CeilingBreakdown(static=180 * GIB, dynamic=190 * GIB, device=8 * GIB, device_kind="cgroup",
                         tier="balanced", total_ram=256 * GIB)
    [text] = advise(plugins, rejection(b, needed=12 * GIB))
    assert "container's memory limit" in text and "memory.max" in text
    assert "--memory=" in text


def test_cuda_device_binding_says_pick_a_smaller_model(plugins):
    b = CeilingBreakdown(static=400 * GIB, dynamic=400 * GIB, device=80 * GIB, device_kind="cuda",
                         tier="balanced")
    [text] = advise(plugins, rejection(b, needed=90 * GIB))
    assert "CUDA" in text and "smaller" in text


@pytest.mark.parametrize("tier, expected", [
    ("safe", "raise the tier to 'balanced' or 'aggressive'"),
    ("balanced", "raise the tier to 'aggressive'"),
    ("aggressive", 'memory.tier = "custom"'),
])
def test_static_binding_says_reduce_context_or_raise_the_tier(plugins, tier, expected):
    b = CeilingBreakdown(static=20 * GIB, dynamic=30 * GIB, tier=tier, total_ram=32 * GIB)
    [text] = advise(plugins, rejection(b))
    assert "reduce the context" in text and expected in text


def test_missing_breakdown_gives_a_generic_but_usable_message(plugins):
    [text] = advise(plugins, rejection(None))
    assert "shorten the prompt" in text.lower()
    assert "memory.tier" in text and "--memory-ceiling" in text and "doctor" in text


def test_forward_stage_advice_mentions_retrying_later(plugins):
    b = CeilingBreakdown(static=20 * GIB, dynamic=30 * GIB, tier="balanced", total_ram=32 * GIB)
    [text] = advise(plugins, rejection(b, stage="forward"))
    assert "retry when fewer requests are running" in text


# -- another rank's ceiling (a distributed group) -------------------------------------------


def remote(breakdown: CeilingBreakdown, stage: str = "forward") -> Rejection:
    """A refusal on rank 0 that rank 1's ``breakdown`` binds: rank 0's judged limit is
    10 GiB, the need 12 GiB there (2 GiB short)."""
    breakdown = replace(breakdown, rank=1, ranks=2, elsewhere="on rank 1 of 2, ...")
    return Rejection(estimated_bytes=4 * GIB, limit_bytes=10 * GIB, breakdown=breakdown,
                     stage=stage, base_bytes=8 * GIB)


def test_another_ranks_static_ceiling_names_that_rank_and_its_tier(plugins):
    b = CeilingBreakdown(static=20 * GIB, dynamic=30 * GIB, tier="balanced", total_ram=32 * GIB)
    [text] = advise(plugins, remote(b))
    assert text.startswith("Rank 1's static ceiling (20.00 GiB: 32.00 GiB total"), text
    assert "raise rank 1's tier to 'aggressive' (memory.tier on rank 1)" in text
    assert "over more than 2 ranks" in text
    assert remote(b).binding == "static" and remote(b).binding_rank == 1


def test_another_ranks_custom_ceiling_says_how_far_to_raise_it_there(plugins):
    b = CeilingBreakdown(static=40 * GIB, custom=16 * GIB, tier="custom")
    [text] = advise(plugins, remote(b))
    # 16 GiB + the 2 GiB shortfall, + 10 %: raised there, not to rank 0's figures.
    assert "Rank 1's pinned ceiling (16.00 GiB" in text
    assert "serve --memory-ceiling 20GiB on rank 1" in text
    assert "rank 1's other ceilings allow up to 40.00 GiB" in text
    [text] = advise(plugins, remote(b, stage="admission"))
    assert "raise it (a larger serve --memory-ceiling on rank 1)" in text  # no figure to go by


def test_another_ranks_device_and_dynamic_ceilings_say_where_to_act(plugins):
    metal = CeilingBreakdown(static=60 * GIB, device=16 * GIB, device_kind="metal",
                             tier="aggressive", total_ram=64 * GIB)
    [text] = advise(plugins, remote(metal))
    assert "Rank 1's Metal GPU wired-memory limit (16.00 GiB)" in text
    assert re.search(r"iogpu\.wired_limit_mb=\d+` on rank 1", text), text
    dynamic = CeilingBreakdown(static=40 * GIB, dynamic=12 * GIB, tier="balanced",
                               reclaimable=3 * GIB)
    [text] = advise(plugins, remote(dynamic))
    assert text.startswith("Close other applications on rank 1"), text


# -- third-party advice ------------------------------------------------------------------------


class ExtraAdvice:
    @hookimpl
    def on_rejection(self, rejection):
        return f"Ask ops for a bigger box (binding: {rejection.binding})."


class ReplacingAdvice:
    @hookimpl(wrapper=True)
    def on_rejection(self, rejection):
        builtin = yield
        assert builtin, "the built-in advice ran underneath"
        return ["Call the help desk at extension 4242."]


def test_a_third_party_hookimpl_adds_advice(plugins):
    plugins.register(ExtraAdvice(), "extra")
    b = CeilingBreakdown(static=20 * GIB, dynamic=30 * GIB, tier="balanced", total_ram=32 * GIB)
    texts = advise(plugins, rejection(b))
    assert len(texts) == 2
    assert any("reduce the context" in t for t in texts)
    assert "Ask ops for a bigger box (binding: static)." in texts


def test_a_wrapper_hookimpl_replaces_the_advice(plugins):
    plugins.register(ReplacingAdvice(), "replacing")
    b = CeilingBreakdown(static=20 * GIB, dynamic=30 * GIB, tier="balanced", total_ram=32 * GIB)
    assert advise(plugins, rejection(b)) == ["Call the help desk at extension 4242."]


def test_an_admission_refusal_advises_a_ceiling_under_which_it_is_admitted(plugins):
    """Admission compares running reservations + the idle baseline + the margin + the
    request against the admitting share of the hard limit: the advised ceiling holds all
    of it, so it is above today's (not just 1.1 x the reservations)."""
    from omlx_core.memory.admission import AdmissionQueue
    from omlx_core.memory.types import LimitSnapshot, RequestRejected

    hard = 1000 * MIB
    queue = AdmissionQueue(queue_size=0, timeout_s=5.0, admit_watermark=0.9,
                           margin_bytes=lambda _: 50 * MIB)
    queue.update(LimitSnapshot(hard_bytes=hard, baseline_bytes=600 * MIB,
                               breakdown=CeilingBreakdown(custom=hard, tier="custom")))
    running = queue.admit("running", 200 * MIB)  # 600 + 50 + 200 = 850 of 900 admitted
    with pytest.raises(RequestRejected) as refused:
        queue.admit("second", 100 * MIB)  # queue_size 0: refused at once
    running.release()
    rejection = refused.value.rejection
    assert rejection.stage == "admission"
    assert rejection.limit_bytes == 900 * MIB and rejection.needed_bytes == 950 * MIB
    [text] = advise(plugins, rejection)
    # 950 MiB admitted under a ceiling of 950 / 0.9 = 1055.6 MiB; + 10 %, rounded up to 256 MiB
    target = re.search(r"to at least ([\d.]+) GiB", text)
    assert target and float(target.group(1)) * 1024 >= 950 / 0.9, text
    assert "serve --memory-ceiling 1280MiB" in text, text


@pytest.mark.parametrize("tier, expected", [
    ("safe", "raise the memory tier to 'balanced' or 'aggressive' (memory.tier)"),
    ("balanced", "raise the memory tier to 'aggressive' (memory.tier)"),
    ("aggressive", None),
])
def test_dynamic_binding_also_says_raise_the_memory_tier(plugins, tier, expected):
    """The dynamic ceiling is the tier's share of what is free: a tier above takes more
    (the design history's rung, which the advice lacked)."""
    b = CeilingBreakdown(static=40 * GIB, dynamic=int(36.7 * GIB), tier=tier,
                         total_ram=48 * GIB, reclaimable=12 * GIB, own_footprint=int(31.2 * GIB))
    [text] = advise(plugins, rejection(b))
    assert "Close other applications" in text
    if expected is None:
        assert "memory tier" not in text
    else:
        assert expected in text
