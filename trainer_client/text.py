"""Token ids of a rollout back to text, trainer-side.

The server fills the `text` column when asked (`return_text=True`); `decode` does the same for
any table afterwards, with the model's tokenizer: a `tokenizers.Tokenizer` (or a transformers
tokenizer), the path of a tokenizer.json, or a model directory holding one (the server's
`--model`). Like the server, it leaves special tokens out unless told otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from rollout.errors import InvalidArgument


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as it is; a path (tokenizer.json, or a directory holding one) loaded with
    the tokenizers library. InvalidArgument naming `tokenizer` when there is none at the path."""
    if not isinstance(tokenizer, str | Path):
        if not callable(getattr(tokenizer, "decode", None)):
            raise InvalidArgument("tokenizer", f"must be a tokenizer or a path, got {type(tokenizer).__name__}")
        return tokenizer
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise InvalidArgument("tokenizer", f"{file} does not exist (give a tokenizer.json or a model directory)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises bare Exceptions on bad files
        raise InvalidArgument("tokenizer", f"cannot read {file}: {e}") from None


def decode(table: pa.Table, tokenizer: Any, column: str = "token_ids", skip_special_tokens: bool = True) -> list[str]:
    """Each row's `column` (token_ids, or prompt_token_ids) as text, in row order."""
    tok = load_tokenizer(tokenizer)
    if column not in table.column_names:
        raise InvalidArgument("column", f"{column!r} is not a column of the table")
    return [tok.decode(ids, skip_special_tokens=skip_special_tokens) for ids in table.column(column).to_pylist()]
