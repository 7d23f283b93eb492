"""How TVM objects cross a process boundary: TVM's own JSON (never pickle), zlib-compressed and
base64-armoured where it travels inside a JSON message."""
from __future__ import annotations

import base64
import zlib


def pack_json_text(text: str) -> str:
    """Compress a (large) JSON text into an ASCII string that fits inside a JSON message."""
    return base64.b64encode(zlib.compress(text.encode(), 6)).decode("ascii")


def unpack_json_text(packed: str) -> str:
    return zlib.decompress(base64.b64decode(packed.encode("ascii"))).decode()


def dump_ir(mod) -> str:
    """IRModule/PrimFunc -> packed TVM JSON (round-trips with TVM 0.27 + tvm-ffi 0.1.14)."""
    import tvm

    return pack_json_text(tvm.ir.save_json(mod))


def load_ir(packed: str):
    import tvm

    return tvm.ir.load_json(unpack_json_text(packed))
