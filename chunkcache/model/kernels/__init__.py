"""The C kernels of the CPU's quantized products and their Python side.

- `qkernel*.c`, `qkernel*.h`: the C sources, compiled together into one library at first use.
- `build`: compiling, caching (by the sources' hash) and loading that library; `kernels()`, its state.
- `qkernel`: the products' Python side: what serves where, the int4 / int8 / GGUF block products,
  a decode row's norm and attention, AMX's tiles, and the torch custom ops compiled graphs call.
- `block_types`: the GGUF block types the kernels read as they are (sizes, library codes, tiles).
- `quant_blocks`: a weight held as its GGUF blocks (`BlocksPart`, `weights native`).

Nothing is imported here: `from chunkcache.model.kernels import qkernel` loads what it needs.
"""
