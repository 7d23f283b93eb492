import pytest

from shared.errors import MessageError, ShareError, TargetError
from shared.messages import JobSpec, MeasureBatch, check_share, lane_kind, target_kind


@pytest.mark.parametrize("share", [0, 150, -5, 101])
def test_share_outside_range(share):
    with pytest.raises(ShareError, match="1..100"):
        check_share(share)


def test_targets():
    assert target_kind("llvm") == "llvm"
    assert target_kind({"kind": "cuda", "arch": "sm_90"}) == "cuda"
    assert target_kind('{"kind": "llvm", "num-cores": 2}') == "llvm"
    assert lane_kind("llvm") == "cpu" and lane_kind("cuda") == "gpu"
    with pytest.raises(TargetError, match="unknown target 'vulkan'"):
        target_kind("vulkan")


def test_job_spec_validation_names_the_field():
    with pytest.raises(MessageError, match="share"):
        JobSpec.parse({"job_id": "j", "target": "llvm", "share": 0, "trials": 4})
    with pytest.raises(MessageError, match="trials"):
        JobSpec.parse({"job_id": "j", "target": "llvm", "share": 50})
    with pytest.raises(MessageError, match="unknown target"):
        JobSpec.parse({"job_id": "j", "target": "opencl", "share": 50, "trials": 4})


def test_malformed_messages():
    with pytest.raises(MessageError, match="MeasureBatch"):
        MeasureBatch.parse("{not json")
    with pytest.raises(MessageError, match="candidates"):
        MeasureBatch.parse({"batch_id": "b", "job_id": "j", "target": "{}"})
    with pytest.raises(MessageError, match="evil: Extra inputs"):
        MeasureBatch.parse({"batch_id": "b", "job_id": "j", "target": "{}", "candidates": [], "evil": 1})


def test_oversized_message_is_refused_before_parsing():
    from shared.messages import MAX_MESSAGE_BYTES

    with pytest.raises(MessageError, match="exceeds"):
        MeasureBatch.parse(b"x" * (MAX_MESSAGE_BYTES + 1))


def test_a_measure_result_has_timings_or_an_error_of_a_kind():
    from shared.errors import MessageError
    from shared.messages import ErrorKind, MeasureResult

    assert MeasureResult.parse({"candidate_id": "c", "run_secs": [1e-3]}).error_kind is None
    failed = MeasureResult.parse({"candidate_id": "c", "error": "build failed: x", "error_kind": "build"})
    assert failed.error_kind == ErrorKind.BUILD
    for bad in ({"candidate_id": "c"}, {"candidate_id": "c", "error": "run failed: x"},
                {"candidate_id": "c", "run_secs": [1e-3], "error_kind": "run"},
                {"candidate_id": "c", "error": "x", "error_kind": "no such kind"}):
        with pytest.raises(MessageError):
            MeasureResult.parse(bad)


def test_a_build_request_carries_its_rounds_priority_within_the_transports_steps():
    from shared.messages import BuildRequest

    batch = {"batch_id": "b", "job_id": "j", "target": "llvm", "candidates": []}
    assert BuildRequest.parse({"lane": "measure.cpu.c0", "batch": batch}).priority == 0
    assert BuildRequest.parse({"lane": "measure.cpu.c0", "batch": batch, "priority": 1}).priority == 1
    with pytest.raises(MessageError, match="priority"):
        BuildRequest.parse({"lane": "measure.cpu.c0", "batch": batch, "priority": 10})
