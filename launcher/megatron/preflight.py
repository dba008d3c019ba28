"""Preflight: build the Megatron config in the driver, on CPU, and check its layout before placing.

A layout that does not fit exits 2 before any placement group exists. The driver needs
megatron-bridge for this; without it the launch goes on and the ranks find out themselves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..core.errors import UsageError
from ..core.layout import Layout, layout_problems
from ..core.progress import TrainingFacts
from ..core.spec import LaunchSpec
from ..core.target import TargetKind
from .facts import facts_from_config

log = logging.getLogger("megaray")


@dataclass(frozen=True)
class Plan:
    """What the preflight learned: the layout, the resolved config (for the run directory), and
    the facts progress reporting needs (sequence length, batch, iterations, FLOPs per token)."""

    layout: Layout
    config: Any
    facts: TrainingFacts


def preflight(spec: LaunchSpec) -> Plan | None:
    target = spec.target
    if target.kind is not TargetKind.MEGATRON or target.recipe is None:
        return None
    t0 = time.monotonic()
    try:
        from .bridge_target import build_config

        cfg, notes = build_config(target.recipe, list(target.args), target.hf_path)
    except ModuleNotFoundError as e:
        if spec.check_only:
            raise UsageError(
                f"--check needs megatron-bridge in the driver ({e}); install megaray[megatron]"
            ) from None
        log.warning(
            "preflight skipped: %s in the driver (install megaray[megatron] to check layouts here)", e
        )
        return None
    layout = Layout.from_config(cfg)
    problems = layout_problems(layout, spec.nodes, spec.gpus_per_node)
    if problems:
        raise UsageError(
            f"recipe {target.recipe.name}: layout {layout.describe()} does not fit: " + "; ".join(problems)
        )
    dp = spec.world_size // (layout.tp * layout.pp * layout.cp)
    log.info(
        "preflight: %s, DP %d fits %d rank(s) (%.1f s)",
        layout.describe(),
        dp,
        spec.world_size,
        time.monotonic() - t0,
    )
    for note in notes:
        log.info("preflight: %s", note)
    return Plan(layout, cfg, facts_from_config(cfg))
