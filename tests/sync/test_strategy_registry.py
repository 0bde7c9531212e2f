"""One description per strategy (issue 44): the code outside sync/ asks ``sync.describe(name)``,
and no module compares a strategy's name with a string."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from slipstream import sync
from slipstream.errors import ConfigError
from slipstream.sync import OptionSet, StrategyInfo, SyncKind, UnknownStrategy
from slipstream.sync.options import SyncOptionsError, check_sync_options

SRC = Path(sync.__file__).resolve().parents[1]  # src/slipstream
# sync/ owns the names; plan/costmodel.py is the planner's own cost model of each codec.
OWNERS = ("sync/", "plan/costmodel.py")
# An expression that holds a strategy name: its source names a strategy or a sync setting.
STRATEGY_LIKE = re.compile(r"strateg|sync", re.IGNORECASE)


def _names_in(node: ast.expr) -> set[str]:
    """The strategy names (or ``hierarchical+`` prefixes) a constant, tuple, list or set spells."""
    known = set(sync.available())
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)
            and (e.value in known or e.value.startswith("hierarchical+"))}


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, source) of each ``==``/``!=``/``in``/``not in`` of a strategy-like expression with a
    strategy name, and of each ``.startswith``/``.split`` of one on ``hierarchical+``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, (a, b) in zip(node.ops, zip(sides, sides[1:])):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                for name_side, other in ((a, b), (b, a)):
                    if _names_in(name_side) and STRATEGY_LIKE.search(ast.unparse(other)):
                        found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "split", "partition") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.startswith("hierarchical")
              and STRATEGY_LIKE.search(ast.unparse(node.func.value))):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_the_scan_finds_what_it_is_for():
    """The scan itself: each form the old code used is found; a precision or codec test is not."""
    old = '\n'.join([
        'if self.sync.strategy == "diloco": pass',
        'self._fixes_order = strategy != "diloco"',
        'ok = config.sync.strategy in ("allreduce", "bf16")',
        'base = strategy.split("+", 1)[1] if strategy.startswith("hierarchical+") else strategy',
        'flag = layout.sync != "allreduce"',
    ])
    assert [line for line, _ in name_comparisons(old)] == [1, 2, 3, 4, 5]
    fine = 'a = precision == "bf16"\nb = codec.name != "allreduce"\nc = sync.describe(s).heals_in_place'
    assert name_comparisons(fine) == []


def test_no_strategy_name_is_compared_outside_sync():
    """Adding a strategy must touch sync/ only: everything else asks its description."""
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(OWNERS):
            continue
        hits += [f"src/slipstream/{rel}:{line}: {code}" for line, code in name_comparisons(path.read_text())]
    assert not hits, "strategy names compared outside sync/ (ask sync.describe(name)):\n" + "\n".join(hits)


def test_every_strategy_is_described():
    for name in sync.available():
        info = sync.describe(name)
        assert isinstance(info, StrategyInfo) and info.name == name


@pytest.mark.parametrize("name", sync.available())
def test_the_descriptions_answer_as_the_old_name_tests_did(name):
    """The answers the code outside sync/ used to derive from the name itself."""
    info = sync.describe(name)
    assert info.fixes_bucket_order == (name != "diloco")          # layout_dp, adopt
    assert info.on_sharded_replicas == (name == "diloco")         # config, layout_mesh
    assert info.heals_in_place                                     # every built-in strategy heals in place (#43)
    assert (info.kind is SyncKind.REDUCER) == (name == "allreduce")  # config's mesh rule, adopt's hook guard
    assert info.installs_comm_hook == (name != "allreduce")
    assert info.levels == (2 if name.startswith("hierarchical") else 1)
    if name.startswith("hierarchical+") and name != "hierarchical+auto":
        assert info.codec == name.split("+", 1)[1]


def test_named_descriptions():
    diloco, allreduce, h_bf16 = sync.describe("diloco"), sync.describe("allreduce"), sync.describe("hierarchical+bf16")
    assert (diloco.kind, diloco.fixes_bucket_order, diloco.on_sharded_replicas) == (SyncKind.OUTER_LOOP, False, True)
    assert (allreduce.kind, allreduce.heals_in_place, allreduce.options) == (SyncKind.REDUCER, True, OptionSet.NONE)
    assert (h_bf16.kind, h_bf16.levels, h_bf16.codec, h_bf16.options) == (SyncKind.HOOK, 2, "bf16", OptionSet.CODEC)
    assert sync.describe("hierarchical").codec == "allreduce"
    assert sync.describe("hierarchical+auto").auto and sync.describe("auto").codec is None
    assert sync.matching(lambda i: i.heals_in_place) == tuple(sync._REGISTRY)  # every registered one


def test_an_unknown_name_says_which_it_meant():
    with pytest.raises(UnknownStrategy, match=r"unknown sync strategy 'dilcoo' \(did you mean 'diloco'\?\); known: "):
        sync.describe("dilcoo")
    assert issubclass(UnknownStrategy, KeyError) and issubclass(UnknownStrategy, ConfigError)
    with pytest.raises(KeyError):
        sync.describe("hierarchical+gzip")


def test_help_text_comes_from_the_registry():
    from slipstream.config import SyncConfig

    help_text = SyncConfig.__dataclass_fields__["strategy"].metadata["help"]
    assert help_text == "gradient sync strategy (allreduce, bf16, fp16, powersgd, topk, sign, hierarchical[+X], auto, diloco)"


def test_a_registered_strategy_gets_a_description(monkeypatch):
    """A strategy registered without a description: a comm hook that checks its own options."""
    monkeypatch.setattr(sync, "_REGISTRY", dict(sync._REGISTRY))
    monkeypatch.setattr(sync, "_INFO", dict(sync._INFO))
    sync.register("mine")(lambda ddp_model, **options: None)
    info = sync.describe("mine")
    assert (info.kind, info.options, info.fixes_bucket_order, info.heals_in_place) == (SyncKind.HOOK, OptionSet.OWN,
                                                                                         True, False)
    check_sync_options("mine", {"anything": 1})  # its own to check
    assert "mine" in sync.available() and "mine" in sync.strategies_help()
    with pytest.raises(ValueError, match="description of 'other'"):
        sync.register("mine", StrategyInfo("other", SyncKind.HOOK))


def test_options_still_checked_by_description():
    with pytest.raises(SyncOptionsError, match="takes no options"):
        check_sync_options("allreduce", {"rank": 4})
    with pytest.raises(SyncOptionsError, match="unknown options: rnk"):
        check_sync_options("hierarchical+powersgd", {"rnk": 4})
    check_sync_options("hierarchical+auto", {"observe_steps": 2, "rank": 2})
    check_sync_options("diloco", {"inner_steps": 5})


def test_only_a_replica_strategy_joins_sharded_replicas():
    with pytest.raises(ConfigError, match="sync 'bf16' is a DDP gradient hook; only 'diloco' synchronises"):
        sync.apply_to_replicas("bf16", object(), None)  # type: ignore[arg-type]
