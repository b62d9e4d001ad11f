"""Several ranks on gloo over 127.0.0.1: failure handling (parity across ranks is in test_parity.py)."""

from infinity.testing.parity import engine_config, run_with_a_dying_rank


def test_a_dead_rank_makes_the_other_fail_with_a_clear_error_in_bounded_time(tmp_path):
    cfg = engine_config("cpu", **{"infinity.comm_timeout_s": 30})
    record = run_with_a_dying_rank(cfg, str(tmp_path / "rank0.json"))
    assert not record["hung"], "rank 0 must not hang"
    assert record["error"] == "RankFailure", record
    assert "failed on rank 0 of 2" in record["message"] and "another rank probably died" in record["message"]
    assert record["seconds"] < 30, record


def test_a_hung_rank_makes_the_other_fail_after_the_comm_timeout(tmp_path):
    cfg = engine_config("cpu", **{"infinity.comm_timeout_s": 4})
    record = run_with_a_dying_rank(cfg, str(tmp_path / "rank0.json"), how="hang")
    assert not record["hung"], "rank 0 must not hang"
    assert record["error"] == "RankFailure", record
    assert 3 <= record["seconds"] < 30, record
