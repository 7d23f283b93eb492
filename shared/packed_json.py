"""How TVM objects cross a process boundary: TVM's own JSON text (never pickle), zlib-compressed and
base64-armoured where it travels inside a JSON message. Only the text half lives here, so `shared` needs
no TVM: each TVM boundary (a service's metaschedule/ package) turns objects into that text and back."""
from __future__ import annotations

import base64
import zlib


def pack_json_text(text: str) -> str:
    """Compress a (large) JSON text into an ASCII string that fits inside a JSON message."""
    return base64.b64encode(zlib.compress(text.encode(), 6)).decode("ascii")


def unpack_json_text(packed: str) -> str:
    return zlib.decompress(base64.b64decode(packed.encode("ascii"))).decode()
