"""TVM IR to and from the wire (shared.packed_json packs the text): candidates arrive as packed TVM JSON.
The measurer keeps its own two lines rather than import the tuner's: the services are independent."""
from __future__ import annotations

import tvm

from shared.packed_json import pack_json_text, unpack_json_text


def dump_ir(mod) -> str:
    """IRModule/PrimFunc -> packed TVM JSON (round-trips with TVM 0.27 + tvm-ffi 0.1.14)."""
    return pack_json_text(tvm.ir.save_json(mod))


def load_ir(packed: str):
    return tvm.ir.load_json(unpack_json_text(packed))


def clip_error(err: Exception, limit: int = 2000) -> str:
    """An exception as the text a result carries: its type and message, clipped in the middle."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2 :]
