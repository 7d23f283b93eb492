"""An artifact a builder shipped: checked (size, base64, checksum) before the lane loads it."""
from __future__ import annotations

from shared.messages import MAX_ARTIFACT_BYTES, Artifact


def artifact_bytes(art: Artifact) -> bytes:
    """The artifact's library, checked: ValueError naming what is wrong with it."""
    import base64
    import binascii
    import hashlib

    if art.size > MAX_ARTIFACT_BYTES:
        raise ValueError(f"artifact of {art.size} bytes exceeds the limit of {MAX_ARTIFACT_BYTES}")
    if len(art.data) > (MAX_ARTIFACT_BYTES * 4) // 3 + 4:
        raise ValueError(f"artifact data of {len(art.data)} base64 characters exceeds the limit of {MAX_ARTIFACT_BYTES} bytes")
    try:
        data = base64.b64decode(art.data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("artifact data is not valid base64") from None
    if len(data) != art.size:
        raise ValueError(f"artifact is {len(data)} bytes, its header says {art.size}")
    if hashlib.sha256(data).hexdigest() != art.sha256:
        raise ValueError("artifact checksum mismatch (corrupted in transit)")
    return data


def load(art: Artifact):
    """The artifact's library loaded into this process: ValueError naming what is wrong with it."""
    import os
    import tempfile

    import tvm

    from services.measurer.metaschedule.candidate_codec import clip_error

    data = artifact_bytes(art)
    fd, path = tempfile.mkstemp(prefix="sharetune-built-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return tvm.runtime.load_module(path)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"cannot load it: {clip_error(err)}") from None
    finally:
        os.remove(path)  # the loaded library stays mapped
