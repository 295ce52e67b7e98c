"""The chosen PyTorch tests (tests/torch_ports/cases.py, from the torch wheel through the
shim) and what each does on shoal today. test_torch_ports.py fails when a test that passed
fails, or when an expected failure passes (then move it to PASSING). About 40 s per test on two
shared cores (four spawned ranks each), so the list stays short enough for a 5-minute run."""

PASSING = [
    "ShoalRpcTest::test_self_add",
    "ShoalRpcTest::test_add",
    "ShoalRpcTest::test_scalar_add",
    "ShoalDistAutogradTest::test_autograd_context",
]

# test id -> why it fails on shoal today.
FAILING = {
    "ShoalRpcTest::test_worker_id":
        "rpc_agent.get_worker_info('WorkerUnknown') raises \"Unknown worker 'WorkerUnknown': "
        "this job has workers ...\"; torch's test matches torch's message 'could not find "
        "destination'",
}

CHOSEN = PASSING + list(FAILING)
