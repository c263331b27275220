"""The learner: packed, chunked log-probs of sampled tokens; micro-batched AdamW steps on fp32 masters;
weight sync to the sampler (quantize once, share or ship codes and scales)."""

from minite.learner.batch import SequenceBatch
from minite.learner.learner import Learner, batch_logprobs, micro_batches
from minite.learner.logprobs import chunked_token_logprobs, pack, sequence_logprobs
from minite.learner.optimizer import MasterAdamW
from minite.learner.weight_sync import (
    export_quantized_weights,
    load_quantized_weights,
    quantized_weights,
    sync_weights,
)

__all__ = ["Learner", "MasterAdamW", "SequenceBatch", "batch_logprobs", "chunked_token_logprobs",
           "export_quantized_weights", "load_quantized_weights", "micro_batches", "pack", "quantized_weights",
           "sequence_logprobs", "sync_weights"]
