"""DeRS compression of vanilla upcycled MoEs (DeRS paper, Sec. 3.2-3.3):
decompose into base + deltas, replace the deltas by sparse / quantised forms, save them as a
compressed orbax checkpoint, and run inference that synthesises each expert on the fly.

DeRS *upcycling* (trainable SM / LM experts) lives in :mod:`moejax.nn.ders_moe` and
:mod:`moejax.upcycle`."""

from moejax.ders_compress.ckpt import disk_bytes, load_compressed, save_compressed
from moejax.ders_compress.compress import (
                                  CompressedDeRS,
                                  QuantSpec,
                                  compress,
                                  compression_report,
                                  decompress,
                                  decompress_deltas,
)
from moejax.ders_compress.decompose import (
                                  Decomposed,
                                  bases_from_dense,
                                  decompose,
                                  expert_cosines,
                                  moe_layers,
                                  recompose,
)
from moejax.ders_compress.synth import (
                                  DeRSBuffer,
                                  SynthMoE,
                                  SynthMoEConfig,
                                  build_synth_model,
                                  synth_decoder_config,
                                  unpack_codes,
)

__all__ = [
    "CompressedDeRS", "QuantSpec", "Decomposed", "DeRSBuffer", "SynthMoE", "SynthMoEConfig",
    "bases_from_dense", "build_synth_model", "compress", "compression_report", "decompose",
    "decompress", "decompress_deltas", "disk_bytes", "expert_cosines", "load_compressed",
    "moe_layers", "recompose", "save_compressed", "synth_decoder_config", "unpack_codes",
]
