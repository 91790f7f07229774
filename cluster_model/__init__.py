"""cluster_model: the Fire-Flyer 2 cluster (arXiv 2408.14158) modelled from its mechanisms.

Topology rules, node bandwidths and the algorithms' byte counts predict the paper's tables and
figures; the same pieces answer what-if questions from a TOML file. See ``README.md`` in this
package for the assumptions, and ``python -m cluster_model report`` for the comparison.
"""

from cluster_model.cluster import Cluster, load_cluster
from cluster_model.collectives import AllreduceResult, Collective
from cluster_model.config import ConfigError
from cluster_model.cost import ClusterCost, CostModel
from cluster_model.failures import FailureModel
from cluster_model.node import Node
from cluster_model.storage import StorageSystem
from cluster_model.topology import Topology, multi_plane, three_layer_fat_tree, two_layer_fat_tree, two_zone
from cluster_model.training import MODELS, ModelSpec, StepTime, TrainingJob

__all__ = [
    "MODELS",
    "AllreduceResult",
    "Cluster",
    "ClusterCost",
    "Collective",
    "ConfigError",
    "CostModel",
    "FailureModel",
    "ModelSpec",
    "Node",
    "StepTime",
    "StorageSystem",
    "Topology",
    "TrainingJob",
    "load_cluster",
    "multi_plane",
    "three_layer_fat_tree",
    "two_layer_fat_tree",
    "two_zone",
]
