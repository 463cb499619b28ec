"""Tensor parallelism across processes with ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

A tensor-parallel LM runs as one *driver* (the process that serves the node for the Conductor:
the in-process Runtime or a placement worker) and ``tp_size - 1`` *followers* it starts. Each
rank holds its share of the attention heads, MLP columns and paged KV cache; the driver decides
every page and ships each step's inputs to the followers (docs/tensor_parallel.md).

* :mod:`~mstar_rt.distributed.split` -- which share a rank holds (imported by the models);
* :mod:`~mstar_rt.distributed.group` -- the process group and its collectives;
* :mod:`~mstar_rt.distributed.llama_shards` -- a rank's slice of a HF Llama checkpoint;
* :mod:`~mstar_rt.distributed.follower` -- the follower process;
* :mod:`~mstar_rt.distributed.tp_driver` -- the driver (:func:`load_tp`), whatever the LM;
* :mod:`~mstar_rt.distributed.llama_tp` -- a Llama split (:func:`load_llama_tp`); Qwen3-Omni's
  thinker: :mod:`mstar_rt.models.qwen3_omni.thinker_tp`.

Prefill/decode disaggregation moves a request's KV pages between processes
(docs/disaggregation.md):

* :mod:`~mstar_rt.distributed.kv_transfer` -- the KV channel (send/recv on a two-rank group);
* :mod:`~mstar_rt.distributed.kv_handoff` -- the walk boundary (``PrefillSide``, ``DecodeSide``);
* :mod:`~mstar_rt.distributed.disagg` -- ``DisaggregatedLM``, two processes;
* :mod:`~mstar_rt.distributed.disagg_worker` -- its decode process.
"""

from mstar_rt.distributed.split import WHOLE, TensorSplit, check_split

__all__ = ["TensorSplit", "WHOLE", "check_split"]
