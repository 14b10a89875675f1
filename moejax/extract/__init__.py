"""Expert extraction from trained dense MLPs (MoEE, Berisha et al. 2025) and the MoEfication
baseline (Zhang et al. 2022).

* :mod:`~moejax.extract.cluster`: HDBSCAN (and the ablation's DBSCAN, OPTICS, k-means, BIRCH,
  random) clustering of recorded hidden activations.
* :mod:`~moejax.extract.plan`: per-layer :class:`ExpertPlan` s: MoEE's variance-based neuron
  selection and mean-input routers; MoEfication's constrained balanced k-means experts and
  parameter centres.
* :mod:`~moejax.extract.layer_surgery`: record FFN inputs/activations; replace dense FFNs by
  :class:`~moejax.nn.extracted.ExtractedFFN` slots; the compact (serving) layout.
* :mod:`~moejax.extract.macs`: exact MAC and parameter accounting.
* :mod:`~moejax.extract.pipeline`: the recipe end to end (record, cluster, plan, extract,
  MoEfication at matched MACs, its MLP router).
"""

from moejax.extract.cluster import (
                                 CLUSTER_METHODS,
                                 ClusterConfig,
                                 cluster_activations,
                                 n_clusters_of,
)
from moejax.extract.layer_surgery import (
                                 apply_model,
                                 copy_model,
                                 dense_ffn_layers,
                                 extract_model,
                                 ffn_holder,
                                 record_ffn,
                                 slot_layers,
)
from moejax.extract.macs import ffn_macs, model_macs, param_breakdown, param_counts
from moejax.extract.plan import (
                                 ExpertPlan,
                                 balanced_kmeans_partition,
                                 cluster_means,
                                 kept_neurons,
                                 moee_plan,
                                 moefication_plan,
                                 select_neurons,
)

__all__ = ["CLUSTER_METHODS", "ClusterConfig", "cluster_activations", "n_clusters_of", "ffn_macs",
           "model_macs", "param_breakdown", "param_counts", "ExpertPlan",
           "balanced_kmeans_partition", "cluster_means", "kept_neurons", "moee_plan",
           "moefication_plan", "select_neurons",
           "apply_model", "copy_model", "dense_ffn_layers", "extract_model", "ffn_holder",
           "record_ffn", "slot_layers"]
