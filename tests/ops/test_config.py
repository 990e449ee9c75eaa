"""OverlapConfig's typed transports (NcclTransport, PeerCopyTransport), its cross-field
rules at construction, and the public ops' signatures without test hooks."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

import overlap
from overlap import NcclTransport, OverlapConfig, PeerCopyTransport
from overlap import _library
from overlap.kernels.tile_gemm import GemmConfig

WS = GemmConfig(warp_specialize=True)


def test_typed_transport_equals_flat() -> None:
    pairs = [
        (OverlapConfig(transport=NcclTransport(ctas=8), chunks=2),
         OverlapConfig(transport="nccl", nccl_ctas=8, chunks=2)),
        (OverlapConfig(transport=NcclTransport()), OverlapConfig(transport="nccl")),
        (OverlapConfig(transport=PeerCopyTransport(reduce_ctas=24, fold_norm=True), chunks=8, give_back=False),
         OverlapConfig(transport="p2p", reduce_ctas=24, fold_norm=True, chunks=8, give_back=False)),
        (OverlapConfig(transport=PeerCopyTransport(reduce_ctas=66, reduce_shared=True, two_shot=True)),
         OverlapConfig(transport="p2p", reduce_ctas=66, reduce_shared=True, two_shot=True)),
        (OverlapConfig(transport=PeerCopyTransport()), OverlapConfig(transport="p2p")),
    ]
    for typed, flat in pairs:
        assert typed == flat and hash(typed) == hash(flat), (typed, flat)
        assert typed.transport in ("nccl", "p2p")  # the ops read the name
        assert _library.config_id(typed) == _library.config_id(flat)
        assert {typed: 1}[flat] == 1
    # the same option given both ways, with one value: accepted
    assert OverlapConfig(transport=NcclTransport(ctas=8), nccl_ctas=8) == OverlapConfig(transport="nccl", nccl_ctas=8)
    # a normalized config goes through dataclasses.replace as any other
    cfg = OverlapConfig(transport=NcclTransport(ctas=8))
    assert dataclasses.replace(cfg, chunks=4) == OverlapConfig(transport="nccl", nccl_ctas=8, chunks=4)


def test_transport_options() -> None:
    assert OverlapConfig().transport_options is None
    assert OverlapConfig(nccl_ctas=8, reduce_ctas=24).transport_options is None  # chosen by the call
    assert OverlapConfig(transport="nccl", nccl_ctas=8).transport_options == NcclTransport(ctas=8)
    assert OverlapConfig(transport="p2p", reduce_ctas=24, two_shot=True).transport_options == \
        PeerCopyTransport(reduce_ctas=24, two_shot=True)
    for cfg in (OverlapConfig(transport="nccl", chunks=2, nccl_ctas=16, sm_margin=24),
                OverlapConfig(transport="p2p", chunks=4, reduce_ctas=66, reduce_shared=True, fold_norm=True)):
        assert dataclasses.replace(cfg, transport=cfg.transport_options) == cfg  # round trip
    with pytest.raises(dataclasses.FrozenInstanceError):
        NcclTransport(ctas=8).ctas = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        NcclTransport(8)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("kw,match", [
    # peer-copy options on the NCCL transport
    (dict(transport="nccl", reduce_ctas=16), "reduce_ctas: peer-copy"),
    (dict(transport="nccl", reduce_shared=True), "reduce_shared: peer-copy"),
    (dict(transport="nccl", two_shot=True), "two_shot: peer-copy"),
    (dict(transport="nccl", fold_norm=True), "fold_norm: peer-copy"),
    (dict(transport=NcclTransport(ctas=8), reduce_ctas=16), "reduce_ctas: peer-copy"),
    # the NCCL option on the peer-copy transport
    (dict(transport="p2p", nccl_ctas=8), "nccl_ctas: an NCCL"),
    (dict(transport=PeerCopyTransport(), nccl_ctas=8), "nccl_ctas: an NCCL"),
    # a typed transport and a flat field of it that disagree
    (dict(transport=NcclTransport(ctas=8), nccl_ctas=4), "disagree"),
    (dict(transport=PeerCopyTransport(reduce_ctas=16), reduce_ctas=24), "disagree"),
    (dict(transport=PeerCopyTransport(reduce_shared=False), reduce_shared=True), "disagree"),
    # the reduce programs beside a warp-specialized GEMM
    (dict(transport="p2p", reduce_shared=True, gemm=WS), "warp-specialized"),
    (dict(transport=PeerCopyTransport(reduce_shared=True), gemm=WS), "warp-specialized"),
    # the typed options' own ranges
    (dict(transport="nccl", nccl_ctas=65), r"nccl_ctas must be in \[1, 64\]"),
    # a flattened GEMM takes rows statically: no give-back grid, no split tail
    (dict(gemm=GemmConfig(flatten=True)), "give-back"),
    (dict(gemm=GemmConfig(flatten=True), give_back=False, split_tail=2), "split tail"),
    (dict(gemm=GemmConfig(flatten=True), give_back=False, fold_norm=True), "folded"),
    (dict(transport="p2p", reduce_shared=True, give_back=False, gemm=GemmConfig(flatten=True)), "flattened"),
])
def test_cross_field_rules_raise_at_construction(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OverlapConfig(**kw)


def test_typed_options_check_their_ranges() -> None:
    for bad in (lambda: NcclTransport(ctas=0), lambda: NcclTransport(ctas=65),
                lambda: PeerCopyTransport(reduce_ctas=0), lambda: PeerCopyTransport(reduce_ctas=2000)):
        with pytest.raises(ValueError, match="must be in"):
            bad()


def test_transport_chosen_at_call_time_keeps_both_transports_fields() -> None:
    # transport=None: each field applies where its transport is picked
    cfg = OverlapConfig(chunks=2, nccl_ctas=8, reduce_ctas=16, reduce_shared=True, fold_norm=True, two_shot=True)
    cfg.check_for("nccl")
    cfg.check_for("p2p")
    # a warp-specialized GEMM with reduce_shared: constructed, refused when the call picks p2p
    ws = OverlapConfig(reduce_shared=True, gemm=WS)
    ws.check_for("nccl")
    with pytest.raises(ValueError, match="warp-specialized"):
        ws.check_for("p2p")
    # the flat spellings the tuners and tests use stay accepted
    OverlapConfig(chunks=2, nccl_ctas=16, sm_margin=24, transport="nccl")
    OverlapConfig(chunks=8, reduce_ctas=24, give_back=False, transport="p2p")
    OverlapConfig(chunks=4, reduce_ctas=16, two_shot=True, fold_norm=True, reduce_shared=True, transport="p2p")
    OverlapConfig(transport="nccl", gemm=WS, split_tail=8)
    OverlapConfig(transport="p2p", gemm=WS, split_tail=8)


def test_public_mlp_chain_has_no_test_hooks() -> None:
    hooks = {"consumer_first", "_producer_delay_cycles", "producer_delay_cycles"}
    for fn in (overlap.mlp_chain, overlap.ops.mlp_chain):
        assert not hooks & set(inspect.signature(fn).parameters), (fn, inspect.signature(fn))
    from overlap.ops import chain

    assert {"consumer_first", "producer_delay_cycles"} <= set(inspect.signature(chain._mlp_chain).parameters)
    # the private entry runs (here the reference path: no GPU) with its hooks
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 6), torch.randn(6, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "no tile-flag path" warning
        y = chain._mlp_chain(x, w1, w2, consumer_first=True, producer_delay_cycles=0)
    torch.testing.assert_close(y, chain.mlp_chain_ref(x, w1, w2))


def test_the_block_boundary_drops_peer_copy_options_it_has_no_use_for() -> None:
    """A config naming no transport may carry the peer-copy all-reduce's options (they
    apply where a call picks that transport); the boundary runs on NCCL only and drops
    them, keeping the rest, instead of refusing the config."""
    from overlap.ops import OverlapConfig
    from overlap.ops.boundary import _nccl

    cfg = OverlapConfig(fold_norm=True, reduce_ctas=8, two_shot=True, reduce_shared=True, nccl_ctas=12,
                        split_tail=2)
    got = _nccl(cfg, 4)
    assert got == OverlapConfig(chunks=4, transport="nccl", nccl_ctas=12, split_tail=2), got


def test_flattened_gemm_with_a_weight_list_is_refused_before_any_work() -> None:
    """A flattened GEMM takes one weight: the plan (built before any collective or push is
    queued) refuses a list for both consumer ops."""
    from overlap.ops import all_gather as ag
    from overlap.ops import all_reduce as ar
    from tests.ops._cpu_runtime import cpu_runtime

    rt = cpu_runtime()
    cfg = OverlapConfig(give_back=False, gemm=GemmConfig(flatten=True))
    for plan in (ag._plan, ar._plan):
        with pytest.raises(ValueError, match="takes one weight"):
            plan(rt, 256, (64, 32), 64, cfg)
    assert ar._plan(rt, 256, 64, 64, cfg).groups is not None  # one weight: planned, with its groups


def test_bucketed_plans_are_an_agreed_value() -> None:
    """Whether a call's plan is per row bucket (its NCCL calls' sizes come from the bucket's
    chunks): NCCL with a per-tile GEMM only; the ops put it among the values the ranks
    agree on, so a rank running a flattened GEMM beside per-tile ones raises instead of
    sending chunks of other sizes."""
    import inspect

    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.ops import OverlapConfig
    from overlap.ops import _runtime
    from overlap.ops import all_gather, all_reduce, matmul_reduce
    from overlap.policies import plan_rows

    flat = OverlapConfig(gemm=GemmConfig(flatten=True), give_back=False)
    assert _runtime.bucketed(OverlapConfig(), "nccl") == 1
    assert _runtime.bucketed(flat, "nccl") == 0
    assert _runtime.bucketed(OverlapConfig(), "p2p") == 0 and _runtime.bucketed(None, "nccl") == 0
    assert _runtime.plan_rows_for(1000, OverlapConfig(), "nccl") == plan_rows(1000) == 1024
    assert _runtime.plan_rows_for(1000, flat, "nccl") == 1000 == _runtime.plan_rows_for(1000, OverlapConfig(), "p2p")
    for mod in (all_gather, all_reduce, matmul_reduce):
        src = inspect.getsource(mod)
        assert src.count('"bucketed"') == src.count("check_agree(rt,") >= 1, mod.__name__


# every field of every config type: the type first (bools are not ints, strings are not
# numbers, nan and inf are not numbers), then the range; the error names the field
_BAD_FIELDS = [
    (OverlapConfig, "chunks", [10**9, 2.5, True, float("nan"), "4", 0, -1]),
    (OverlapConfig, "nccl_ctas", [2.5, 0, 65, True, "8"]),
    (OverlapConfig, "sm_margin", [10**6, -1, 1.5, False, "0"]),
    (OverlapConfig, "give_back", ["no", 1, 0, None]),
    (OverlapConfig, "gemm", ["fast", 1, {"block_m": 64}]),
    (OverlapConfig, "timeout_ms", [1e-9, 0, -5, float("nan"), float("inf"), "100", True, 1e12]),
    (OverlapConfig, "transport", ["NCCL", 1, True]),
    (OverlapConfig, "reduce_ctas", [0, 10**6, 2.5, True]),
    (OverlapConfig, "reduce_shared", ["yes", 1]),
    (OverlapConfig, "two_shot", ["yes", 1]),
    (OverlapConfig, "fold_norm", ["yes", 1]),
    (OverlapConfig, "split_tail", [-1, 65, 2.0, True, None]),
    (OverlapConfig, "check", ["never", 1, None]),
    (NcclTransport, "ctas", [0, 65, 2.5, True, "8"]),
    (PeerCopyTransport, "reduce_ctas", [0, 10**6, 2.5, True]),
    (PeerCopyTransport, "reduce_shared", ["no", 1]),
    (PeerCopyTransport, "two_shot", ["no", 1]),
    (PeerCopyTransport, "fold_norm", ["no", 1]),
    (GemmConfig, "block_m", [True, 8, 96, 2048, 64.0, "64"]),
    (GemmConfig, "block_n", [True, 100, "128"]),
    (GemmConfig, "block_k", [False, 0, 48]),
    (GemmConfig, "num_stages", [0, 100, 2.5, True, "3"]),
    (GemmConfig, "num_warps", [3, 32, True, 8.0]),
    (GemmConfig, "warp_specialize", [1, "yes"]),
    (GemmConfig, "flatten", [1, "yes"]),
    (GemmConfig, "group_m", [0, 2.5, True]),
    (GemmConfig, "tail_block_m", [True, -16, 2.5]),
]


def _chain_bad() -> list:
    from overlap.ops import ChainConfig

    return [(ChainConfig, "reserve_sms", [10**9, 0, 1.5, True, "1"]),
            (ChainConfig, "timeout_ms", [1e-9, float("nan"), "5", True]),
            (ChainConfig, "check", ["never", None]),
            (ChainConfig, "sync", ["rows", None, 1]),
            (ChainConfig, "launch", ["graph", None]),
            (ChainConfig, "producer", ["fast", 1]),
            (ChainConfig, "consumer", ["fast", 1])]


@pytest.mark.parametrize("cls,field,values", _BAD_FIELDS + _chain_bad(),
                         ids=[f"{c.__name__}.{f}" for c, f, _ in _BAD_FIELDS + _chain_bad()])
def test_bad_field_values_refused_at_construction(cls: type, field: str, values: list) -> None:
    for v in values:
        with pytest.raises((TypeError, ValueError), match=rf"\b{field}\b") as e:
            cls(**{field: v})
        assert "not supported between" not in str(e.value), (field, v, e.value)  # a comparison, not a check


def test_good_field_values_still_accepted() -> None:
    import numpy as np

    from overlap.ops import ChainConfig

    OverlapConfig(chunks=np.int64(4), nccl_ctas=8, sm_margin=0, give_back=False, gemm=GemmConfig(block_m=64),
                  timeout_ms=50, transport="nccl", split_tail=8, check="sync")
    OverlapConfig(timeout_ms=2.5, transport=PeerCopyTransport(reduce_ctas=24, two_shot=True, fold_norm=True))
    ChainConfig(reserve_sms=2, timeout_ms=1000, producer=GemmConfig(block_n=128), sync="tile", launch="pdl")
    GemmConfig(block_m=256, block_n=128, num_stages=4, num_warps=4, flatten=True, tail_block_m=64, tail_block_n=64)


def test_a_configs_hash_is_its_fields_computed_once_and_never_pickled() -> None:
    """``OverlapConfig`` hashes as the dataclass would (its fields' tuple), equal configs
    alike; the hash is kept after the first (a replay hashes its signature, config
    included, every call), and a pickled or copied config carries none: string hashes
    differ between processes."""
    import pickle
    import subprocess
    import sys

    cfg = OverlapConfig(chunks=2, transport=NcclTransport(ctas=8), gemm=GemmConfig())
    want = hash(tuple(getattr(cfg, f.name) for f in dataclasses.fields(cfg)))
    assert hash(cfg) == want == hash(OverlapConfig(chunks=2, transport="nccl", nccl_ctas=8, gemm=GemmConfig()))
    assert cfg.__dict__.get("_hash") == want, "the hash is not kept"
    assert {cfg: 1}[OverlapConfig(chunks=2, transport="nccl", nccl_ctas=8, gemm=GemmConfig())] == 1
    assert hash(OverlapConfig(chunks=4)) != hash(OverlapConfig(chunks=2))
    for other in (pickle.loads(pickle.dumps(cfg)), __import__("copy").deepcopy(cfg)):
        assert other == cfg and "_hash" not in other.__dict__ and hash(other) == want
    assert dataclasses.replace(cfg, chunks=3).__dict__.get("_hash") is None
    # a field that cannot be hashed (a list forced in) still makes the config unhashable
    odd = OverlapConfig(chunks=2)
    object.__setattr__(odd, "gemm", [1, 2])
    with pytest.raises(TypeError):
        hash(odd)
    assert "_hash" not in odd.__dict__
    # a config pickled in another process (another string hash seed) hashes as this one's
    code = ("import pickle, sys; from overlap import OverlapConfig, NcclTransport; "
            "c = OverlapConfig(chunks=2, transport=NcclTransport(ctas=8), check='sync'); hash(c); "
            "sys.stdout.buffer.write(pickle.dumps(c))")
    blob = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                          env={**__import__("os").environ, "PYTHONHASHSEED": "12345"}).stdout
    theirs = pickle.loads(blob)
    mine = OverlapConfig(chunks=2, transport=NcclTransport(ctas=8), check="sync")
    assert theirs == mine and hash(theirs) == hash(mine) and {mine: 1}.get(theirs) == 1
