"""The engine's queues alone (serve/scheduler.py): lanes, turns, pass budgets, aborts and expiry,
no model (the engine loop and the server around them: test_slo.py)."""
from prefixscore.serve import protocol as P
from prefixscore.serve.scheduler import Lanes, PassBudget, Row, ScoreJob


def row(rid, tokens=4, deadline=1e18, client=0):  # (distinct ids: equal work costs a pass nothing)
    return Row(client, rid, [1000 + rid] + list(range(tokens - 1)), 0, deadline, 0, None)


def job(rid, n_items=3, item_len=5, priority=0, deadline=1e18, finish_by=0.0):
    m = P.ScoreReq(0, rid, b"", [0], b"", None, None, False, deadline, finish_by, priority, 0.0)
    return ScoreJob(m, None, [[1, 2] + [3] * item_len for _ in range(n_items)], [1, 2])


def test_realtime_before_batch_and_turns_within_a_lane():
    lanes = Lanes()
    lanes.add_row(row(1), 1)  # batch
    lanes.add_job(job(2, priority=1))
    lanes.add_row(row(3), 0)
    lanes.add_row(row(4), 0)
    rt_job = job(5)
    lanes.add_job(rt_job)
    kind, rows, cut = lanes.next_pass(budget=100)
    assert kind == "classify" and [r.rid for r in rows] == [3, 4] and not cut  # every real-time row
    kind, what, _ = lanes.next_pass(100)
    assert kind == "score" and what is rt_job  # then the real-time score job, before batch work
    lanes.finish(rt_job)
    kind, rows, _ = lanes.next_pass(100)
    assert kind == "classify" and [r.rid for r in rows] == [1]  # batch work once the lane is empty
    kind, what, _ = lanes.next_pass(100)
    assert kind == "score" and what.msg.rid == 2


def test_classify_pass_cut_to_the_budget_but_never_empty():
    lanes = Lanes()
    for rid in range(5):
        lanes.add_row(row(rid, tokens=10), 0)
    _, rows, cut = lanes.next_pass(25)
    assert [r.rid for r in rows] == [0, 1] and cut
    assert [r.rid for r in lanes.next_pass(5)[1]] == [2]  # one row over the budget still runs
    assert len(lanes) == 2
    _, rows, cut = lanes.next_pass(1000)
    assert [r.rid for r in rows] == [3, 4] and not cut and len(lanes) == 0


def test_aborted_rows_skipped_and_expiry_at_the_head():
    """An abort marks a row dead through the index (no scan of the queue); dead rows are skipped
    when they reach the head; expiry pops the head's expired rows (start-by times expire in
    arrival order)."""
    lanes = Lanes()
    for rid in range(6):
        lanes.add_row(row(rid, deadline=10.0 + rid), 0)
    rows, _ = lanes.remove({(0, 1), (0, 4), (0, 99)})
    assert sorted(r.rid for r in rows) == [1, 4] and len(lanes) == 4
    rows, _ = lanes.expired(now=12.5)  # rids 0 and 2 (1 is dead)
    assert [r.rid for r in rows] == [0, 2] and len(lanes) == 2
    assert [r.rid for r in lanes.next_pass(100)[1]] == [3, 5]


def test_expiry_and_aborts_take_work_out():
    lanes = Lanes()
    lanes.add_row(row(1, deadline=5.0), 0)
    lanes.add_row(row(2, deadline=25.0), 0)
    queued, running_late, running_ok = job(3, deadline=5.0), job(4, finish_by=20.0), job(5, deadline=5.0)
    running_late.run = running_ok.run = object()  # started: its start-by time no longer counts
    for j in (queued, running_late, running_ok):
        lanes.add_job(j)
    rows, jobs = lanes.expired(now=10.0)
    assert [r.rid for r in rows] == [1] and jobs == [queued]
    rows, jobs = lanes.expired(now=30.0)
    assert [r.rid for r in rows] == [2] and jobs == [running_late]
    rows, jobs = lanes.remove({(0, 5)})
    assert rows == [] and jobs == [running_ok] and len(lanes) == 0


def simulate(b: PassBudget, fixed: float, rate: float, row_tokens: int, passes: int = 60) -> None:
    """Full passes (a long queue) on an engine whose pass costs fixed + tokens / rate."""
    for _ in range(passes):
        taken = max(row_tokens, b.tokens // row_tokens * row_tokens)
        b.observe(fixed + taken / rate, taken)


def test_pass_budget_learns_the_fixed_part_under_load():
    """Calibrated on an idle engine (0.6 ms fixed), run where a pass's fixed part is 1.4 ms (the
    H200 at 3,000 requests/s): the estimate follows, the goal rises to 3x it (a goal under the
    fixed part shrank every pass to a row or two) and the budget is what a pass of the goal holds."""
    rate, target, row_tokens = 2e6, 0.002, 25
    b = PassBudget(target, floor=16)
    b.calibrate(0.0006, 1 / rate)
    assert b.goal == target and abs(b.tokens - rate * (target - 0.0006)) <= 1
    simulate(b, 0.0014, rate, row_tokens)
    assert abs(b.fixed - 0.0014) < 0.02 * 0.0014
    assert abs(b.goal - 3 * 0.0014) < 1e-9 + 0.02 * 3 * 0.0014
    want = rate * (b.goal - b.fixed)
    assert abs(b.tokens - want) < 0.02 * want and b.tokens > 100 * row_tokens
    simulate(b, 0.0002, rate, row_tokens)  # an idle engine again: back to the pass time asked for
    assert b.goal == target and abs(b.tokens - rate * (target - b.fixed)) <= 1


def test_pass_budget_one_slow_pass_moves_it_a_little():
    b = PassBudget(0.002)
    b.calibrate(0.0005, 1e-6)
    before = b.tokens
    b.observe(0.5, 100)  # a GC pause
    assert b.fixed <= 0.0005 + 0.1 * (0.0005 + 1e-4) + 1e-12 and b.tokens >= 0.9 * before


def test_pass_budget_uncalibrated_stays_put():
    b = PassBudget(0.002, first=77)
    b.observe(0.01, 500)
    assert b.tokens == 77 and b.goal == 0.002


def test_batch_rows_ride_along_in_spare_room_and_run_alone_in_small_passes():
    """Real-time rows first; batch rows fill the pass's spare tokens (never past the budget); with
    the real-time lane empty, batch rows run alone in passes of at most `small` tokens."""
    lanes = Lanes()
    for rid in range(3):
        lanes.add_row(row(rid, 10), 0)
    for rid in range(10, 20):
        lanes.add_row(row(rid, 10), 2)
    _, rows, cut = lanes.next_pass(1000, spare=25, small=40)
    assert [r.rid for r in rows] == [0, 1, 2, 10, 11] and not cut
    _, rows, _ = lanes.next_pass(1000, spare=25, small=40)
    assert [r.rid for r in rows] == [12, 13, 14, 15]
    lanes.add_row(row(3, 10), 0)
    _, rows, _ = lanes.next_pass(35, spare=25, small=40)  # room left: 25 tokens, spare 25
    assert [r.rid for r in rows] == [3, 16, 17]
    lanes.add_row(row(4, 30), 0)
    _, rows, _ = lanes.next_pass(35, spare=25, small=40)  # 5 tokens of room: no batch row fits
    assert [r.rid for r in rows] == [4]


def test_pass_budget_fixed_part_is_bounded_when_the_per_token_cost_is_too_low():
    """Calibrated with a per-token cost 4x under the truth (multi-item passes on classify's
    cost), a slow pass read as fixed cost raised the goal and so the next pass's tokens, without
    end (H200: ~80 ms passes). The fixed part stops at `most` x its calibrated value, so passes
    stay bounded: within (goal - fixed) x 4 of the per-token part."""
    true_fixed, true_rate, target = 0.001, 1 / 10e-6, 0.00125
    b = PassBudget(target, floor=256, times=2.0)
    b.calibrate(true_fixed, 2.5e-6)
    simulate(b, true_fixed, true_rate, 8, passes=200)
    assert b.fixed <= 4 * true_fixed + 1e-12
    took = true_fixed + b.tokens / true_rate
    assert took <= true_fixed + 4 * (b.goal - b.fixed) + 1e-9 and took < 0.05, took


def test_classify_gets_as_much_time_as_the_score_pass_before_it():
    """Both kinds waiting in a lane: after a score pass of d seconds, classify passes run until
    they have had d (at least one), then the next score pass: time shared, not turns (one short
    classify pass per long score pass starved classify into 504s)."""
    lanes = Lanes()
    lanes.add_job(job(1, n_items=50))
    for rid in range(10, 40):
        lanes.add_row(row(rid, tokens=10), 0)
    seq = []
    for took in (0.001, 0.010, 0.004, 0.004, 0.004, 0.010, 0.004):
        kind, _, _ = lanes.next_pass(10)  # one row a classify pass
        seq.append(kind)
        lanes.took(took)
    assert seq == ["classify", "score", "classify", "classify", "classify", "score", "classify"]
    lanes2 = Lanes()
    lanes2.add_job(job(2))
    assert lanes2.next_pass(10)[0] == "score"  # alone: no waiting for a share
    lanes2.took(0.5)
    lanes2.add_row(row(3), 0)
    assert lanes2.next_pass(10)[0] == "classify"  # a row that came during it goes next



def test_start_by_ends_a_request_only_before_it_starts():
    """The rows of one client request share a started flag: once one has run, the start-by time
    (--max-queue-ms) no longer ends the others; the client's deadline (finish_by) still does. A
    request none of whose rows started expires as before."""
    lanes = Lanes()
    started, waiting = [False], [False]
    for rid in range(3):
        lanes.add_row(Row(0, rid, [rid, 2, 3, 4], 0, 5.0, 0, None, request=started), 0)
    lanes.add_row(Row(0, 3, [3, 2, 3, 4], 0, 5.0, 0, None, finish_by=8.0, request=started), 0)
    for rid in (4, 5):
        lanes.add_row(Row(0, rid, [rid, 2, 3, 4], 0, 5.0, 0, None, request=waiting), 0)
    _, rows, _ = lanes.next_pass(4)  # the first row runs: its request has started
    assert [r.rid for r in rows] == [0] and started == [True] and waiting == [False]
    rows, _ = lanes.expired(now=6.0)  # past the start-by time: the started request's rows stay
    assert rows == [] and len(lanes) == 5
    assert [r.rid for r in lanes.next_pass(8)[1]] == [1, 2]
    rows, _ = lanes.expired(now=9.0)  # past row 3's own deadline, and 4 and 5 never started
    assert [r.rid for r in rows] == [3, 4, 5] and len(lanes) == 0


def test_clients_take_turns_within_a_lane():
    """A client's flood queued first: another client's rows go a row per turn, not behind the
    flood; each client's rows in arrival order; one client alone is plain arrival order."""
    lanes = Lanes()
    for rid in range(20):
        lanes.add_row(Row(0, rid, [1000 + rid, 1, 2, 3], 0, 1e18, 0, None, tenant=7), 0)
    for rid in (100, 101):
        lanes.add_row(Row(0, rid, [1000 + rid, 1, 2, 3], 0, 1e18, 0, None, tenant=9), 0)
    _, rows, cut = lanes.next_pass(16)  # four rows of 4 tokens
    assert [r.rid for r in rows] == [0, 100, 1, 101] and cut
    _, rows, _ = lanes.next_pass(8)
    assert [r.rid for r in rows] == [2, 3]
    lanes.remove({(0, 4), (0, 5)})
    rows, _ = lanes.expired(now=0.0)
    assert rows == [] and [r.rid for r in lanes.next_pass(8)[1]] == [6, 7]


def test_expiry_in_arrival_order_across_clients():
    """Expiry reads arrival order, whichever client's turn it is: rows of two clients past their
    start-by time are all taken out, rows already run are not answered twice."""
    lanes = Lanes()
    for rid in range(6):
        lanes.add_row(Row(0, rid, [1000 + rid, 1], 0, 10.0 + rid, 0, None, tenant=rid % 2 + 1), 0)
    _, rows, _ = lanes.next_pass(2)  # rid 0 (client 1) runs
    assert [r.rid for r in rows] == [0]
    rows, _ = lanes.expired(now=13.5)
    assert [r.rid for r in rows] == [1, 2, 3] and len(lanes) == 2
    assert [r.rid for r in lanes.next_pass(100)[1]] == [5, 4] and len(lanes) == 0  # client 2's turn
    assert lanes.expired(now=100.0) == ([], [])


def test_the_next_score_job_is_the_least_recently_served_clients():
    """Score jobs: the running one goes on; the next to start is the first job of the client whose
    last job started longest ago (never: first)."""
    lanes = Lanes()
    flood = [job(rid) for rid in range(4)]
    for j in flood:
        j.msg.tenant = 7
    light = job(50)
    light.msg.tenant = 9
    for j in flood + [light]:
        lanes.add_job(j)
    first = lanes.next_pass(100)[1]
    assert first is flood[0]
    first.run = object()
    assert lanes.next_pass(100)[1] is first  # started: it goes on
    lanes.finish(first)
    assert lanes.next_pass(100)[1] is light  # client 9 never started one
    lanes.finish(light)
    assert lanes.next_pass(100)[1] is flood[1]
