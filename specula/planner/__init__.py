"""Hardware-aware planning: cost model, merge of candidate trees, calibrated acceptance, tree
sizing (docs/algorithms.md §4), behind the `Planner` protocol (`specula.planner.base`)."""

from specula.planner.base import PassThroughPlanner, Plan, Planner, PlanRequest, StepTiming
from specula.planner.calibration import Calibrator, CalibrationConfig
from specula.planner.cost import CostCurve, CostModel, load_or_measure_curve, measure_cost_curve, read_cost_curve
from specula.planner.merge import merge_proposals, rasd_prune
from specula.planner.planner import HardwarePlanner, PlannerConfig, PlannerState, PlannerView
from specula.planner.select import chain_lookahead, choose_size, path_probabilities

__all__ = [
    "Calibrator", "CalibrationConfig", "CostCurve", "CostModel", "HardwarePlanner", "PassThroughPlanner", "Plan",
    "PlanRequest", "Planner", "PlannerConfig", "PlannerState", "PlannerView", "StepTiming", "chain_lookahead",
    "choose_size", "load_or_measure_curve", "measure_cost_curve", "merge_proposals", "path_probabilities",
    "rasd_prune", "read_cost_curve",
]
