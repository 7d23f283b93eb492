"""TVM objects to and from the wire (shared.packed_json packs the text): the IR a job's model, its tasks and
the candidates travel as, and the target a job is tuned for. The client encodes a model with dump_ir."""
from __future__ import annotations

import json

import tvm

from shared.packed_json import pack_json_text, unpack_json_text


def dump_ir(mod) -> str:
    """IRModule/PrimFunc -> packed TVM JSON (round-trips with TVM 0.27 + tvm-ffi 0.1.14)."""
    return pack_json_text(tvm.ir.save_json(mod))


def load_ir(packed: str):
    return tvm.ir.load_json(unpack_json_text(packed))


def target_from_json(text: str) -> tvm.target.Target:
    """A target from its JSON (str(target) round-trips)."""
    return tvm.target.Target(json.loads(text))
