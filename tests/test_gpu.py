"""GPU lanes on a real NVIDIA GPU under MPS (marker gpu: run on the GPU machine with
`pytest -m gpu tests/test_gpu.py`; CI has no GPU and deselects them)."""

import pytest

pytestmark = pytest.mark.gpu


def _has_gpu() -> bool:
    try:
        from services.measurer.observers import make_observer

        return bool(make_observer().inventory())
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory):
    if not _has_gpu():
        pytest.skip("no NVIDIA GPU visible through NVML")
    from services.measurer.agent import gpu_lanes
    from sharetune.stack.local import Stack

    st = Stack(tmp_path_factory.mktemp("gpu"), lanes=gpu_lanes("2x50"))
    try:
        st.start(wait_lanes_s=300)
        yield st
    finally:
        st.stop()


def test_gpu_lanes_tune_under_mps_and_records_carry_device_facts(gpu_stack):
    from shared import store
    from sharetune.client import Client

    client = Client(gpu_stack.redis_url)
    lanes = client.lanes()
    assert len(lanes) == 2 and {l.share for l in lanes} == {50} and all(l.kind == "gpu" for l in lanes)
    assert gpu_stack.mps is not None and gpu_stack.mps.is_running()
    job = client.submit("tiny", target="cuda", share=50, trials=16, trials_per_iter=8, seed=0, retime_top_k=1)
    final = job.wait(timeout_s=400)
    assert final["state"] == "done", final
    res = job.result()
    recs = [r for t in store.job_tasks(client.redis, job.job_id) for r in store.records(client.redis, t.wkey)]
    assert len([r for r in recs if r.job_id == job.job_id]) == res.trials
    good = [r for r in recs if r.error is None and r.run_secs]
    assert good and all(r.share == 50 and r.device.get("gpu_uuid") for r in good)
    assert any(r.device.get("sm_clock_mhz") for r in good)
    assert res.retime["retimed"] >= 1
    import numpy as np
    import tvm
    from tvm import relax

    from sharetune.intake import reference_output
    from sharetune.zoo import get

    model, example = get("tiny").build()
    vm = relax.VirtualMachine(tvm.runtime.load_module(res.tuned_module_path), tvm.cuda(0))
    out = vm["main"](tvm.runtime.tensor(example[0].numpy(), tvm.cuda(0)))
    while not hasattr(out, "numpy"):
        out = out[0]
    assert np.max(np.abs(out.numpy() - reference_output(model, example))) < 1e-3
