"""The token embedding of `weights native` held as the GGUF file's own blocks (`model/quant.py`
decides where; apart from it to keep that file short)."""

from __future__ import annotations

import numpy as np
import torch

from chunkcache.model.gguf_blocks import RawTensor


class QuantEmbedding(torch.nn.Module):
    """The token embedding held as the GGUF file stores it (its own blocks: 0.13 GB for the
    1.5B's Q4_K table against 0.93 GB float32), each forward dequantizing only the rows it looks
    up, with gguf's own dequantization: the rows are bit for bit those of the dense table a
    dense load holds (the same function over the same bytes, each row its own blocks), cast to
    the model's dtype as the loader casts. Costs ~0.25 ms per decode step, ~2.4 ms for 256 rows."""

    def __init__(self, raw: RawTensor, dtype: torch.dtype, blocks: torch.Tensor | None = None) -> None:
        """`blocks`: the same bytes already held (a tied lm_head's `BlocksPart`), read in place."""
        super().__init__()
        self.qtype, self.dtype = raw.qtype, dtype
        self.num_embeddings, self.embedding_dim = raw.shape
        # A copy, not the file's memory map: the model owns its bytes (a file replaced on disk
        # while serving would otherwise fault), and the mapping can close after load.
        if blocks is None:
            blocks = torch.from_numpy(np.array(raw.data, copy=True))
        assert blocks.numpy().shape == raw.data.shape
        self.register_buffer("blocks", blocks, persistent=False)

    @torch.compiler.disable  # numpy inside; a compiled decode step breaks its graph here, once
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < self.num_embeddings):
            raise IndexError(f"token id outside the embedding's {self.num_embeddings} rows")
        raw = RawTensor(
            "embedding", self.qtype, self.blocks.numpy(), (self.num_embeddings, self.embedding_dim)
        )
        rows = torch.from_numpy(raw.dequantize(flat.numpy())).to(self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]
