"""The fleet trace simulator: realistic audit histories of a PD deployment, without a model.

Configure with :class:`FleetConfig`; :func:`fleet_batches` yields the record, :func:`write_fleet` stores
it and writes the ground truth (:mod:`kvtrail.sim.fleet.run`).
"""

from kvtrail.sim.fleet.config import FAULT_CLASSES, PLANT_CLASSES, FleetConfig, config_defaults
from kvtrail.sim.fleet.run import ClusterHistory, FleetSummary, cluster_history, fleet_batches, holds_run, write_fleet

__all__ = [
    "FAULT_CLASSES",
    "PLANT_CLASSES",
    "ClusterHistory",
    "FleetConfig",
    "FleetSummary",
    "cluster_history",
    "config_defaults",
    "fleet_batches",
    "holds_run",
    "write_fleet",
]
