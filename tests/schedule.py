"""How pytest-xdist shares the suite out among its workers (scripts/test runs it with ``-n``).

A unit of work runs whole on one worker, in the order a serial run has: a test class, or a module's tests
outside classes (xdist's ``loadscope``), so what a class or module sets up once (a fresh schema, a model
server, a browser, a Django project) is set up once, and tests that follow each other in one database still
do. The modules in ``SPLIT`` are long runs of independent tests that each set up their own (CLI processes,
killed workers, busy sessions): each of their tests is a unit, so one module is not the whole run's tail
(not a module whose tests share a costly module fixture: tests/test_listing_plans.py's fills a database).
Each worker has its own prefix (tests/servers.py): units on two workers share nothing on the servers.

Units start longest first (``COST``), so the run does not end waiting on a long unit that started last.
``COST`` holds what the units far above ``PER_TEST`` seconds a test took in a run of the whole suite (in
4 workers on a 2-core machine, scaled to its serial time), a test of ``SPLIT`` by its function (its slowest
parameter's); the others count ``PER_TEST`` a test. The
figures order the queue and nothing else: a stale one costs balance, never a result.
"""

from __future__ import annotations

from typing import Any

SPLIT = (
    "tests/faults/test_trials.py",
    "tests/reliability/test_crash_resume.py",
    "tests/reliability/test_load.py",
    "tests/reliability/test_stranded.py",
    "tests/test_busy.py",
    "tests/test_cancel_push.py",
    "tests/test_celery_worker.py",
    "tests/test_cli.py",
    "tests/test_context.py",
    "tests/test_context_resume.py",
    "tests/test_django_celery.py",
    "tests/test_footprint.py",
    "tests/test_front_doors.py",
    "tests/test_messages.py",
    "tests/test_review_meet.py",
)

PER_TEST = 0.5

COST: dict[str, float] = {
    "tests/test_store_mongodb.py::TestMongoDBStoreKeepsTheContract": 122,
    "tests/test_django_wheel.py": 95,
    "tests/test_store_sqlite.py::TestSQLiteStoreKeepsTheContract": 63,
    "tests/test_store_sql_servers.py::TestPostgresStoreKeepsTheContract": 55,
    "tests/test_store_sql_servers.py::TestMySQLStoreKeepsTheContract": 50,
    "tests/test_packaging.py": 44,
    "tests/test_console.py": 38,
    "tests/reliability/test_load.py::test_sixteen_processes_steer_one_running_session[mongodb]": 77,
    "tests/reliability/test_load.py::test_sixteen_processes_steer_one_running_session": 34,
    "tests/test_store_redis.py::TestRedisStoreKeepsTheContract": 31,
    "tests/reliability/test_crash_resume.py::"
    "test_runs_killed_at_random_points_resume_from_a_valid_prefix_and_lose_no_steer": 31,
    "tests/test_django_app.py": 31,
    "tests/test_django_celery.py::"
    "test_a_whole_worker_killed_inside_a_tool_is_answered_by_another_the_tool_run_once": 26,
    "tests/test_listing_plans.py": 27,
    "tests/test_front_doors.py::test_both_front_doors_print_the_same_and_exit_the_same": 20,
    "tests/test_busy.py::test_eight_processes_send_five_messages_each_to_a_busy_session": 20,
    "tests/test_review_meet.py::test_an_incarnation_is_never_that_of_the_session_deleted_before_it": 19,
    "tests/test_store_mongodb.py": 17,
    "tests/test_cancel_sqlite.py": 16,
    "tests/test_cli.py::test_hostile_ids_steers_and_metadata_print_as_one_row_each": 15,
    "tests/test_docs.py": 14,
    "tests/test_context.py::test_many_turns_with_compaction_are_all_answered_and_nothing_is_lost": 13,
    "tests/test_django_celery.py::test_ten_messages_to_one_busy_session_from_ten_processes_are_each_answered_once": 13,
    "tests/test_cli.py::test_lifecycle_list_pages_filters_and_prints_the_next_cursor": 12,
    "tests/test_store_sql_servers.py": 12,
    "tests/test_mysql_contention.py": 12,
    "tests/test_django_celery.py::test_a_call_approved_from_the_django_command_runs_once_and_the_turn_is_answered": 11,
    "tests/test_stores_shadowed.py": 10,
    "tests/test_messages.py::test_is_extension_is_the_prefix_compared_by_equality": 9,
    "tests/test_cli.py::test_fork": 9,
    "tests/test_cli.py::test_lifecycle_info_and_metadata": 9,
    "tests/test_cli.py::test_work_answers_what_is_left_until_a_signal_stops_it": 9,
}


def unit(nodeid: str) -> str:
    """The unit a test belongs to: itself in a module of ``SPLIT``, else its class, or its module (a
    parameter's text may hold ``::``)."""
    if nodeid.split("::", 1)[0] in SPLIT:
        return nodeid
    return nodeid.split("[", 1)[0].rsplit("::", 1)[0]


def cost(scope: str, tests: int) -> float:
    """A unit's estimate: its own, else (a test of ``SPLIT``) its function's slowest parameter's."""
    return COST.get(scope) or COST.get(scope.split("[", 1)[0]) or PER_TEST * tests


def scheduler(config: Any, log: Any) -> Any:
    """xdist's loadscope scheduler over these units, handing out the costliest left each time."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            costliest = max(self.workqueue, key=lambda scope: cost(scope, len(self.workqueue[scope])))
            self.workqueue.move_to_end(costliest, last=False)
            super()._assign_work_unit(node)

    return Units(config, log)
