"""The folder ``vas`` writes: ``manifest.json`` (what was asked for, checked on
resumption, and the SHA-256 of each shard) and Parquet shards ``shard-NNNNN.parquet``,
shard s holding records ``[s * shard_size, (s + 1) * shard_size)`` of the DATA file in
order, written and checked by the machinery of ``collect``'s folders (``shards.py``).

One row per record:

| column | type | what |
| --- | --- | --- |
| ``line`` | int64 | the record's line in the JSON Lines file |
| ``answer`` | string | the answer scored: the record's, or the one generated |
| ``generated`` | bool | the answer was generated (the record had none) |
| ``ended`` | bool | the answer ends with the end-of-sequence token (scored with it) |
| ``answer_tokens`` | int64 | tokens scored after the prompt (the end token included) |
| ``answer_logprob`` | float64 | the mean log-probability of those tokens, teacher-forced |
| ``seconds`` | float64 | time of the record (generation, forward and VAS) |
| ``label`` | bool (null: none) | the record's label column (``hallucinated`` by default) |
| ``vas_*`` | float32 | the 36 VAS features of prompt and answer (``headscope.VAS_COLUMNS``) |
| others | as in DATA | every other key of the records, copied (for ``detector eval --group``) |

``pyarrow.parquet.read_table(sorted(Path(DIR).glob("shard-*.parquet")))`` (or pandas'
``read_parquet`` of that list) reads the table without headscope; :func:`read_table`
checks the checksums first.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..vas import VAS_COLUMNS
from .errors import UsageError
from .shards import Layout, checked_shards, read_manifest

# manifest fields added after tables were written, with the value an older one means
LAYOUT = Layout("headscope.vas", 1, ".parquet", "vas", {"quantize": None})
# the table's own columns (before VAS_COLUMNS and the records' other keys), with their types
OWN_COLUMNS = {"line": "int64", "answer": "string", "generated": "bool", "ended": "bool",
               "answer_tokens": "int64", "answer_logprob": "float64", "seconds": "float64",
               "label": "bool"}
RESERVED = (*OWN_COLUMNS, *VAS_COLUMNS)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise UsageError("`python -m headscope vas` and `detector` need pyarrow (pip install "
                         "pyarrow; requirements.txt pins the tested version)") from e
    return pyarrow


def schema(other_columns: Dict[str, str]):
    """The table's Arrow schema: its own columns, the VAS features, then ``other_columns``
    (name: ``bool``, ``int64``, ``float64`` or ``string``)."""
    pa = _pyarrow()
    types = {**OWN_COLUMNS, **{c: "float32" for c in VAS_COLUMNS}, **other_columns}
    return pa.schema([(name, pa.type_for_alias(kind)) for name, kind in types.items()])


def shard_bytes(rows: List[Dict], other_columns: Dict[str, str]) -> bytes:
    """A Parquet file of ``rows`` (each a dict of every column; None where a value is
    missing) under :func:`schema`."""
    pa = _pyarrow()
    table = pa.Table.from_pylist(rows, schema=schema(other_columns))
    sink = io.BytesIO()
    pa.parquet.write_table(table, sink)
    return sink.getvalue()


def read_table(folder: Path) -> Tuple[Dict, Any]:
    """``(manifest, pyarrow Table)`` of a folder written by ``vas``: every shard, checked
    against its recorded SHA-256, joined in DATA order."""
    pa = _pyarrow()
    folder = Path(folder)
    manifest = read_manifest(folder, LAYOUT)
    paths = checked_shards(folder, manifest, LAYOUT)
    want = schema(manifest["columns"])
    tables = []
    for path in paths:
        try:
            table = pa.parquet.read_table(path)
        except (OSError, pa.ArrowException) as e:
            raise UsageError(f"{path}: not a readable Parquet shard: {e}") from e
        if not table.schema.equals(want):
            raise UsageError(f"{path}: its columns are not those of the manifest "
                             f"{folder / 'manifest.json'}")
        tables.append(table)
    return manifest, pa.concat_tables(tables)
