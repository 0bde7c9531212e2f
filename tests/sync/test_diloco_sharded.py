"""``diloco`` composed with ``dp_shard``: each dp_shard group one replica (FSDP2 inside), the outer
step over dp_replicate (4 ranks on gloo: 2 replicas x dp_shard 2).

One spawn runs every multi-rank check (tests/sync/_diloco_sharded_workers.py::suite), all through
``slipstream.accelerate``.
"""

from __future__ import annotations

import pytest

from slipstream.errors import ConfigError
from slipstream.network.link import allreduce_bytes
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    from tests.sync._diloco_sharded_workers import suite as fn

    return run_ranks(fn, 4, str(tmp_path_factory.mktemp("diloco_sharded")), timeout_s=400)


def _ok(results, name):
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    return [r[name] for r in results]


def _crosses(ranks):
    """Whether a collective over ``ranks`` joins ranks of two replicas (replica = rank // 2)."""
    return len({r // 2 for r in ranks}) > 1


def test_h1_lr1_no_momentum_equals_synchronous_training(suite):
    for r in _ok(suite, "averaging_is_sync_sgd"):
        # the outer all-reduce ran over the right group: the result is the mean over all four ranks
        assert r["rel_hsdp"] < 1e-5 and r["rel_ddp"] < 1e-5, r
        assert r["outer_steps"] == 5 and "sharded replicas" in r["summary"], r
        # FSDP2 shards over dp_shard only under diloco; HSDP's mesh holds both dimensions
        assert r["meshes"] == [("dp_shard",)], r
        assert r["hsdp_meshes"] == [("dp_replicate", "dp_shard")], r


def test_inner_steps_send_nothing_across_replicas_and_the_outer_step_does(suite):
    for rank, r in enumerate(_ok(suite, "schedule_and_traffic")):
        assert r["replica_ranks"] == (rank % 2, rank % 2 + 2) and r["shard_ranks"] == (rank // 2 * 2, rank // 2 * 2 + 1)
        for s in r["seen"]:
            outer = s["step"] % 3 == 0
            crossing = [c for c in s["calls"] if _crosses(c[1])]
            # FSDP2's reduce-scatter inside the replica is seen at every step (the tap works)
            assert any(name == "reduce_scatter_single" and ranks == r["shard_ranks"] for name, ranks in s["calls"]), s
            if outer:
                assert crossing and all(ranks == r["replica_ranks"] for _, ranks in crossing), s
                assert s["bytes"] > 0 and s["mode"] == "outer", s
            else:
                assert crossing == [] and s["bytes"] == 0 and s["mode"] == "inner", s
        # one fp32 all-reduce of this rank's shard per outer step (2 ranks: S), none in between
        assert r["outer_steps"] == 2 and r["per_step"] == pytest.approx(allreduce_bytes(4 * r["local_numel"], 2))
        assert r["total"] == pytest.approx(2 * r["per_step"]), r


def test_the_tap_sees_cross_replica_traffic_under_hsdp(suite):
    for r in _ok(suite, "hsdp_control"):
        assert any(name == "all_reduce" and _crosses(ranks) for name, ranks in r["calls"]), r["calls"]


def test_replicas_differ_between_outer_steps_and_agree_right_after(suite):
    for r in _ok(suite, "schedule_and_traffic"):
        assert [s["same"] for s in r["seen"]] == [False, False, True, False, False, True], r["seen"]


def test_clipping_uses_the_replicas_own_gradient_norm(suite):
    results = _ok(suite, "schedule_and_traffic")
    for r in results:
        # the norm before clipping at step 1: the replica's whole gradient (its two ranks' mean)
        assert r["norms"][0] == pytest.approx(r["ref_norm"], rel=1e-5), r
    first = [r["norms"][0] for r in results]
    assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2], first


def test_fragments_with_a_16_bit_codec_on_shards(suite):
    for r in _ok(suite, "fragments_and_codec"):
        assert r["phases"] == [2, 0], r
        step2, step4 = r["seen"][1], r["seen"][3]
        assert step2["same"] == [True, False] and step4["same"] == [False, True], r["seen"]
        # bf16 on the wire: 2 bytes a value of this rank's shard of the fragment
        assert step2["bytes"] == pytest.approx(allreduce_bytes(2 * r["numel"][0], 2)), r
        assert step4["bytes"] == pytest.approx(allreduce_bytes(2 * r["numel"][1], 2)), r
        assert r["seen"][0]["bytes"] == 0 and r["seen"][2]["bytes"] == 0, r["seen"]


def test_accelerate_stopped_and_resumed_ends_bitwise_equal(suite):
    # the checkpoint's "sync" entry restores each rank's own shard, buffers and AdamW moments
    # over the shared checkpoint's (one replica's)
    for r in _ok(suite, "accelerate_resume"):
        assert r["whole_from"] == 0 and r["resumed_from"] == 4, r
        assert r["equal"], r
        # steps 4 and 8 are not outer steps: the replicas differ there, so the check can fail
        assert r["differ_at_resume"] and r["replicas_differ"], r


def test_replicas_start_from_the_first_ones_parameters_and_buffers(suite):
    for r in _ok(suite, "replicas_start_equal"):
        assert r["params"] and r["buffers"] and r["outer_is_local"], r


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from tests.sync._diloco_sharded_workers import two_ranks as fn

    return run_ranks(fn, 2, str(tmp_path_factory.mktemp("diloco_one_replica")), timeout_s=200)


@pytest.mark.parametrize("where", ["two_ranks", "suite"])
def test_one_replica_is_plain_fsdp_said_in_one_line(where, request):
    # dp_shard=2 on 2 ranks, and dp_shard=4 on 4: dp_replicate(1), nothing to join
    results = _ok(request.getfixturevalue(where), "one_replica")
    shards = len(results)
    for rank, r in enumerate(results):
        assert r["sync"] and r["equal"], r  # no strategy installed: bitwise plain FSDP2
        assert f"dp_replicate(1) x dp_shard({shards})" in r["layout"], r
        said = [line for line in r["log"] if "one replica" in line]
        assert len(said) == (1 if rank == 0 else 0), r["log"]
        assert not said or "plain FSDP2" in said[0] and "\n" not in said[0], said


def test_accepted_with_dp_shard_and_refused_with_tp_or_pp_in_one_line():
    from slipstream.config import TrainConfig

    TrainConfig(sync="diloco", dp_shard=2)
    TrainConfig(sync="diloco", dp_shard=2, dp_replicate=2, sync_options={"inner_steps": 4, "fragments": 2})
    for degrees, named in (({"tp": 2}, r"tp\(2\)"), ({"pp": 2}, r"pp\(2\)"),
                           ({"dp_shard": 2, "tp": 2}, r"tp\(2\)")):
        with pytest.raises(ConfigError, match=rf"^sync 'diloco' with {named} is not supported") as err:
            TrainConfig(sync="diloco", **degrees)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="precision fp16"):
        TrainConfig(sync="diloco", dp_shard=2, precision="fp16")
