"""Ceilings from made-up probe readings: every ceiling, every binding case, and what is
left when probes fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_core.config import load_config
from omlx_core.memory.ceilings import ProbeReadings, TierPolicy, compute_ceilings, read_probes
from omlx_core.memory.probes import (
    CgroupMemory,
    CudaMemory,
    LinuxMeminfo,
    MacMemory,
    ProbeUnavailable,
    ProcessFootprint,
)
from omlx_core.memory.types import CeilingBreakdown

GIB = 1024**3
MIB = 1024**2

BALANCED = TierPolicy("balanced", reserve_fraction=0.25, reserve_min=3 * GIB, dynamic_factor=0.85,
                      admit_watermark=0.9)
SAFE = TierPolicy("safe", reserve_fraction=0.35, reserve_min=4 * GIB, dynamic_factor=0.70,
                  admit_watermark=0.8)


def meminfo(total: int, available: int) -> LinuxMeminfo:
    return LinuxMeminfo(total_bytes=total, available_bytes=available, free_bytes=available,
                        reclaimable_bytes=available, swap_total_bytes=0, swap_free_bytes=0)


def footprint(rss: int) -> ProcessFootprint:
    return ProcessFootprint(rss, rss, "test")


def cgroup(limit: int | None, usage: int | None = None, inactive: int | None = None) -> CgroupMemory:
    return CgroupMemory(version=2, path=Path("/sys/fs/cgroup/test"), limit_bytes=limit,
                        usage_bytes=usage, inactive_file_bytes=inactive)


def linux(total=32 * GIB, available=20 * GIB, rss=2 * GIB, **kwargs) -> ProbeReadings:
    return ProbeReadings(system="Linux", meminfo=meminfo(total, available),
                         footprint=footprint(rss), cgroup=kwargs.pop("cgroup", cgroup(None)), **kwargs)


def mac(total=64 * GIB, reclaimable=40 * GIB, wired=None, working_set=48 * GIB, rss=4 * GIB):
    return ProbeReadings(
        system="Darwin",
        mac=MacMemory(total_bytes=total, reclaimable_bytes=reclaimable, page_size=16384,
                      wired_limit_bytes=wired),
        metal_working_set=working_set, footprint=footprint(rss))


# -- each ceiling --------------------------------------------------------------------------


def test_static_is_total_less_the_fractional_reserve():
    b = compute_ceilings(linux(total=32 * GIB), BALANCED)
    assert b.static == 32 * GIB - 8 * GIB  # 25 % of 32 GiB beats the 3 GiB minimum


def test_static_reserve_never_below_reserve_min():
    b = compute_ceilings(linux(total=8 * GIB, available=6 * GIB), BALANCED)
    assert b.static == 8 * GIB - 3 * GIB  # 25 % would be 2 GiB


def test_dynamic_is_reclaimable_plus_own_footprint_times_factor():
    b = compute_ceilings(linux(available=10 * GIB, rss=2 * GIB), BALANCED)
    assert b.dynamic == int(12 * GIB * 0.85)
    assert b.reclaimable == 10 * GIB and b.own_footprint == 2 * GIB


def test_cgroup_limit_is_the_device_ceiling_on_linux():
    b = compute_ceilings(linux(cgroup=cgroup(6 * GIB, usage=2 * GIB)), BALANCED)
    assert (b.device, b.device_kind) == (6 * GIB, "cgroup")


def test_unlimited_cgroup_sets_no_device_ceiling():
    b = compute_ceilings(linux(cgroup=cgroup(None)), BALANCED)
    assert b.device is None and b.device_kind is None and b.notes == ()


def test_cgroup_room_bounds_reclaimable_inside_a_container():
    # The host has 20 GiB available, but the container may only grow by 3 GiB more.
    readings = linux(available=20 * GIB, rss=1 * GIB,
                     cgroup=cgroup(8 * GIB, usage=5 * GIB + 512 * MIB, inactive=512 * MIB))
    b = compute_ceilings(readings, BALANCED)
    assert b.reclaimable == 3 * GIB
    assert b.dynamic == int(4 * GIB * 0.85)
    assert any("cgroup's room" in note for note in b.notes)


def test_metal_wired_limit_is_the_device_ceiling_when_set():
    b = compute_ceilings(mac(wired=56 * GIB, working_set=48 * GIB), BALANCED)
    assert (b.device, b.device_kind) == (56 * GIB, "metal")


def test_metal_recommended_working_set_when_no_wired_limit():
    b = compute_ceilings(mac(wired=None, working_set=48 * GIB), BALANCED)
    assert (b.device, b.device_kind) == (48 * GIB, "metal")


def test_cuda_device_memory_is_the_device_ceiling():
    readings = linux(total=512 * GIB, available=400 * GIB,
                     cuda=CudaMemory(device_name="H100", total_bytes=80 * GIB))
    b = compute_ceilings(readings, BALANCED)
    assert (b.device, b.device_kind) == (80 * GIB, "cuda")


def test_smallest_device_limit_wins_and_the_others_are_noted():
    readings = linux(total=512 * GIB, available=400 * GIB, cgroup=cgroup(64 * GIB, usage=GIB),
                     cuda=CudaMemory(device_name="H100", total_bytes=80 * GIB))
    b = compute_ceilings(readings, BALANCED)
    assert (b.device, b.device_kind) == (64 * GIB, "cgroup")
    assert any("cuda 80.00 GiB" in note for note in b.notes)


def test_custom_ceiling_applies_only_under_tier_custom():
    custom = TierPolicy("custom", 0.0, 0, 1.0, 0.95, custom_ceiling=3 * GIB)
    b = compute_ceilings(linux(), custom)
    assert b.custom == 3 * GIB and b.tier == "custom"
    ignored = compute_ceilings(linux(), TierPolicy("balanced", 0.25, 3 * GIB, 0.85, 0.9,
                                                   custom_ceiling=3 * GIB))
    assert ignored.custom is None
    assert any("ignored under tier 'balanced'" in note for note in ignored.notes)


def test_custom_tier_without_a_ceiling_says_how_to_set_one():
    b = compute_ceilings(linux(), TierPolicy("custom", 0.0, 0, 1.0, 0.95, custom_ceiling=0))
    assert b.custom is None
    assert any("--memory-ceiling" in note for note in b.notes)


# -- which one binds -----------------------------------------------------------------------


@pytest.mark.parametrize("readings, policy, binding, hard", [
    # Plenty reclaimable: total less reserve is the smallest.
    (linux(total=32 * GIB, available=30 * GIB, rss=1 * GIB), BALANCED, "static", 24 * GIB),
    # Other programs hold memory: reclaimable-based ceiling is below the static one.
    (linux(total=32 * GIB, available=6 * GIB, rss=2 * GIB), BALANCED, "dynamic",
     int(8 * GIB * 0.85)),
    # A 4 GiB container on a big host.
    (linux(total=256 * GIB, available=200 * GIB, cgroup=cgroup(4 * GIB, usage=GIB)), BALANCED,
     "device", 4 * GIB),
    # A pinned ceiling below everything else.
    (linux(), TierPolicy("custom", 0.0, 0, 1.0, 0.95, custom_ceiling=GIB), "custom", GIB),
    # A Mac whose wired limit is the floor.
    (mac(total=64 * GIB, reclaimable=60 * GIB, wired=20 * GIB), BALANCED, "device", 20 * GIB),
])
def test_hard_limit_is_the_smallest_and_binding_names_it(readings, policy, binding, hard):
    b = compute_ceilings(readings, policy)
    assert b.binding == binding
    assert b.hard == hard == min(b.ceilings().values())


def test_tie_names_the_first_ceiling_in_order():
    b = CeilingBreakdown(static=GIB, dynamic=GIB, device=2 * GIB)
    assert b.binding == "static"


# -- probes that fail ------------------------------------------------------------------------


def test_failed_meminfo_leaves_device_and_custom_with_a_note():
    readings = ProbeReadings(
        system="Linux", meminfo=ProbeUnavailable("meminfo", "cannot read /proc/meminfo"),
        footprint=footprint(GIB), cgroup=cgroup(6 * GIB, usage=GIB))
    b = compute_ceilings(readings, BALANCED)
    assert b.static is None and b.dynamic is None
    assert (b.hard, b.binding) == (6 * GIB, "device")
    assert any("cannot read /proc/meminfo" in note for note in b.notes)


def test_failed_footprint_counts_reclaimable_only():
    readings = ProbeReadings(system="Linux", meminfo=meminfo(32 * GIB, 10 * GIB),
                             footprint=ProbeUnavailable("footprint", "no VmRSS line"),
                             cgroup=cgroup(None))
    b = compute_ceilings(readings, BALANCED)
    assert b.dynamic == int(10 * GIB * 0.85)
    assert any("no VmRSS line" in note for note in b.notes)


def test_failed_cgroup_probe_is_noted_and_the_rest_still_apply():
    readings = linux(cgroup=ProbeUnavailable("cgroup", "cannot read /proc/self/cgroup"))
    b = compute_ceilings(readings, BALANCED)
    assert b.device is None and b.static is not None and b.dynamic is not None
    assert any("cannot read /proc/self/cgroup" in note for note in b.notes)


def test_failed_mac_probe_falls_back_to_the_metal_working_set():
    readings = ProbeReadings(system="Darwin", mac=ProbeUnavailable("macos", "vm_stat failed"),
                             metal_working_set=48 * GIB, footprint=footprint(GIB))
    b = compute_ceilings(readings, BALANCED)
    assert (b.hard, b.binding, b.device_kind) == (48 * GIB, "device", "metal")
    assert any("vm_stat failed" in note for note in b.notes)


def test_failed_cuda_probe_is_noted():
    readings = linux(cuda=ProbeUnavailable("cuda", "mx.device_info(mx.gpu) failed"))
    b = compute_ceilings(readings, BALANCED)
    assert b.device is None
    assert any("CUDA memory unknown" in note for note in b.notes)


def test_everything_failing_gives_no_hard_limit_and_says_so():
    readings = ProbeReadings(system="Linux", meminfo=ProbeUnavailable("meminfo", "gone"),
                             footprint=ProbeUnavailable("footprint", "gone"),
                             cgroup=ProbeUnavailable("cgroup", "gone"))
    b = compute_ceilings(readings, BALANCED)
    assert b.hard is None and b.binding is None
    assert any("no ceiling could be computed" in note for note in b.notes)


# -- tiers from configuration, and the live machine -----------------------------------------


def test_tier_policy_comes_from_the_configuration():
    config = load_config(tier="cpu-small", env={})
    policy = TierPolicy.from_config(config)
    assert (policy.name, policy.reserve_fraction, policy.reserve_min) == ("safe", 0.35, 4 * GIB)
    assert (policy.dynamic_factor, policy.admit_watermark) == (0.70, 0.80)
    custom = TierPolicy.from_config(load_config(
        tier="cpu-small", env={}, overrides=[("memory.tier", "custom", "test"),
                                             ("memory.custom_ceiling", "1.5GiB", "test")]))
    assert (custom.name, custom.custom_ceiling, custom.reserve_fraction) == (
        "custom", int(1.5 * GIB), 0.0)


def test_safer_tiers_give_lower_ceilings():
    readings = linux(total=32 * GIB, available=20 * GIB)
    assert compute_ceilings(readings, SAFE).hard < compute_ceilings(readings, BALANCED).hard


def test_live_readings_give_a_hard_limit_on_this_machine():
    b = compute_ceilings(read_probes(), BALANCED)
    assert b.hard is not None and b.hard > 0
    assert b.total_ram and b.own_footprint
