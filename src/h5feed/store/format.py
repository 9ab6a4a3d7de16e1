"""This is the store's format: what an h5feed store holds on disk, in which version, and where it is implemented.

Three modules implement it, and a change to the format changes all three:

- `h5feed.store.layout` writes it: the group and its arrays (`create_arrays`), the shards (`encode_shard`,
  `chunk_encoder`), the attributes (`StoreInfo`, `write_info`), and reads the attributes back (`read_info`);
- `h5feed.store.reader` reads its samples on the CPU: the index, each shard's index, the inner chunks and
  their checksums (with `h5feed.store.sources`, which fetches a shard's bytes);
- `h5feed.gpu.frames` parses the Blosc frames of its inner chunks for the GPU path, which `h5feed.gpu.nvcomp`
  decodes.

Beside the format, a store holds its writers' bookkeeping: the conversion's plan, the journals
(`h5feed.store.journal`) and the writers' locks (`h5feed.store.writer_state`), which readers do not need.

Format 2 (written today), one Zarr v3 group:

    aux_hidden_states   [rows, K*H]  storage dtype (bf16 bits as uint16)
    last_hidden_states  [rows, H]
    input_ids           [rows]       int64
    loss_mask           [rows]       int64
    index/...           one row per sample (see `INDEX_COLUMNS`)

Each token array is sharded along the tokens: a shard holds `shard_tokens` rows
as inner chunks of `chunk_tokens` rows, each encoded ``bytes -> blosc -> crc32c``
(zarr's own codecs), followed by the shard index (offset and length of each
inner chunk, then its crc32c).  Every sample starts on a shard boundary, so a
sample is one object per array (by default the shard is as long as the longest
sample), writers never share an object, and every byte a reader decodes is
checked by a checksum any Zarr v3 reader checks too.  Inner chunks past a
sample's end are absent (zarr reads them as the fill value 0).

Format 3 is format 2 with optional parts, written only by stores that have
some (format-2 readers then refuse such a store by its version instead of
misreading it): per-token `extra_arrays` beside the four above (e.g.
`inputs_embeds` [rows, H], `position_ids` [rows], `target_probs` [rows, Vd]),
sharded, chunked and checksummed exactly like them; no `last_hidden_states`
(`has_last_state` false: a NeMo Automodel cache holds none); and the attributes
`ids_shifted`, `source_info` and `companions` (files kept in `companions/`).
`index/checksum` then has one column per stored array, in `StoreInfo.array_names`
order.

Format 4 is format 3 with FP8 hidden states (`precision` "fp8", written only by FP8 stores, so that older
readers refuse them by their version instead of handing out their bytes as bf16): `aux_hidden_states` and
`last_hidden_states` hold float8_e4m3fn bits (uint8), and `hidden_states_scales` [rows] the float32 scale of each
token over all its hidden states (`h5feed.store.fp8`), sharded, chunked and checksummed like the others (its
checksum column follows the four core arrays').  `dtype` is then the dtype reads deliver (bfloat16), and
`quantized_from` the source dtype the conversion quantized (empty when the source files held FP8 already).

Any format's index group may carry in its attributes (`IndexDigest`) the crc32c of its rows, written by
the conversion after the rows: readers check it at open, and a store without it opens unchecked.  A store
that `open_writer` writers share in a bucket names its index group in the root's attributes (`COMMIT_KEY`);
any other has it at `DEFAULT_INDEX`.

Format 1 (still read): the same arrays unsharded, one file per chunk of
`chunk_tokens` rows, no per-chunk checksum; samples start on chunk boundaries
and `index/checksum` holds crc32c of each sample's decoded bytes.
"""

from __future__ import annotations

import numpy as np

STORE_FORMAT_VERSION = 2
OPTIONAL_ARRAYS_FORMAT_VERSION = 3  # format 2 + optional parts (see the module docstring)
FP8_FORMAT_VERSION = 4  # format 3 + FP8 hidden states and their per-token scales
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)

ATTRS_KEY = "h5feed"  # the group's attributes (`StoreInfo`), and the index group's digest, under this key
COMMIT_KEY = "h5feed_commit"  # in the root's attributes, beside ATTRS_KEY: a bucket writer's last commit
DEFAULT_INDEX = "index"  # the index group of a local store, a converter's, and a bucket store before commits

HIDDEN_ARRAYS = ("aux_hidden_states", "last_hidden_states")
HIDDEN_SCALES = "hidden_states_scales"  # an FP8 store's per-token scales (hs-connectors' key)
TOKEN_ARRAYS = ("input_ids", "loss_mask")
CHECKSUMMED = HIDDEN_ARRAYS + TOKEN_ARRAYS
INDEX_COLUMNS = ("sample_start", "sample_length", "source_path", "source_index", "checksum", "has_loss_mask")
COMPANIONS_DIR = "companions"  # files the trainer needs beside the samples, kept byte for byte

EMPTY = np.uint64(2**64 - 1)  # a shard index entry of an absent inner chunk
CRC_BYTES = 4  # zarr's crc32c codec: 4 little-endian bytes after what they cover
BLOSC_MAX_OVERHEAD = 16  # c-blosc's header; a chunk that does not compress is stored copied, behind it
