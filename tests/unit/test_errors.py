from sparktrain.errors import DataError, PeerLostError, WorkerError


def test_task_errors_are_recovered_from_spark_text():
    text = (
        "py4j.protocol.Py4JJavaError: An error occurred while calling o1.collect.\n"
        "Traceback (most recent call last):\n"
        '  File "loop.py", line 3, in train\n'
        "sparktrain.errors.DataError: rank 1: 3 rows have NaN or infinite features\n"
        "\tat org.apache.spark.api.python.BasePythonRunner..."
    )
    err = WorkerError.from_spark(RuntimeError(text))
    assert isinstance(err, DataError)
    assert str(err) == "rank 1: 3 rows have NaN or infinite features"


def test_unknown_failures_keep_spark_first_line():
    err = WorkerError.from_spark(RuntimeError("\nJob aborted due to stage failure\nmore"))
    assert type(err) is WorkerError and "Job aborted due to stage failure" in str(err)


def test_unknown_failures_name_the_innermost_exception():
    text = (
        "py4j.protocol.Py4JJavaError: An error occurred while calling o1.collect.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: boom\n"
        "Traceback (most recent call last):\n"
        "ZeroDivisionError: division by zero\n"
    )
    err = WorkerError.from_spark(RuntimeError(text))
    assert str(err) == "the training stage failed: ZeroDivisionError: division by zero"


def test_peer_lost_names_the_rank_and_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(PeerLostError(3, "connection reset")))
    assert err.rank == 3 and "rank 3" in str(err)
