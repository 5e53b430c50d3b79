"""Models over Spark Connect's request cap, against a Connect server of its own whose
cap is set low (``spark.connect.grpc.maxInboundMessageSize=4m``): a fit whose task closes
over a 9.9 MB pretrained MLP, and the ml transform of that model. Both would be refused
by the server if the weights went in the plan; they go through the driver's payload
service instead (:mod:`sparktrain.driver.services.payload_server`), and the test checks that they
did."""

from __future__ import annotations

import copy
import functools
import gc
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import Trainer
from sparktrain.driver.services import payload_server
from sparktrain.driver.spark_env import spark_env
from sparktrain.ml import TorchClassificationModel
from sparktrain.models import mlp
from sparktrain.result import state_to_bytes
from sparktrain.task.payload_client import ServedBytes

from .fixtures import (
    ConnectServer,
    accuracy,
    client_session,
    connect_mode,
    digits,
    digits_frames,
    fast_config,
    java_missing,
)

pytestmark = [pytest.mark.connect, pytest.mark.timeout(240)]

CAP = "4m"
HIDDEN = (1536, 1536)  # 2.47M float32 parameters: 9.9 MB, over twice the cap
BIG_KWARGS: dict[str, Any] = {"in_features": 64, "hidden": list(HIDDEN), "out_features": 10}


@pytest.fixture(scope="module")
def capped_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A client session of a Connect server of this module's own, with the request cap
    at 4 MiB; the server is stopped at the end of the module."""
    reason = java_missing()
    if reason:
        pytest.skip(reason)
    workdir: Path = tmp_path_factory.mktemp("capped-connect-server")
    conf = {"spark.connect.grpc.maxInboundMessageSize": CAP}
    with ConnectServer(workdir, conf=conf) as server:
        session = client_session(server.url)
        try:
            yield session
        finally:
            if server.running():
                with connect_mode():
                    session.stop()


def _pretrained() -> torch.nn.Module:
    torch.manual_seed(7)
    return mlp(64, HIDDEN, 10)


def test_a_fit_whose_task_holds_the_weights_gets_it_from_the_driver(capped_spark, caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sparktrain")
    assert spark_env(capped_spark).max_request_bytes() == 4 << 20
    pretrained = _pretrained()
    size = sum(p.numel() * p.element_size() for p in pretrained.parameters())
    assert size > 2 * (4 << 20)
    train, test = digits_frames(capped_spark)
    cfg = fast_config(
        strategy="ring", epochs=2, batch_size=64, optimizer="adam", lr=1e-3, optimizer_kwargs={}
    )
    # fine-tuning a model held in memory: the factory closes over its weights
    result = Trainer(functools.partial(copy.deepcopy, pretrained), cfg).fit(
        train, validation_data=test
    )
    closure = result.summary["task_closure"]
    assert closure["via"] == "driver service" and closure["bytes"] > size
    assert closure["fetches"] == cfg.num_workers  # every task fetched it from this client
    assert "the tasks fetch it from the driver's payload service" in caplog.text
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) >= 0.9
    # and a small task still travels in the plan
    small = Trainer("sparktrain.models:digits_mlp", cfg.replace(epochs=1)).fit(train)
    assert small.summary["task_closure"]["via"] == "closure"


def test_transform_of_a_model_over_the_cap_serves_its_weights(capped_spark, caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sparktrain")
    module = _pretrained().eval()
    blob = state_to_bytes(module.state_dict())
    model = TorchClassificationModel()._set(modelFn="sparktrain.models:mlp", modelKwargs=BIG_KWARGS)
    model._set_state(blob, num_features=64, num_outputs=10)
    _, test = digits_frames(capped_spark)
    out = model.transform(test).select("features", "prediction").collect()
    shipped = model._served[1] if model._served is not None else None
    assert isinstance(shipped, ServedBytes) and shipped.nbytes == len(blob) > 2 * (4 << 20)
    served_by = [s for s in payload_server._SHARED.values() if s.address == shipped.address]
    assert served_by and served_by[0].fetches >= 1  # the executors' Python workers fetched them
    assert "transform's tasks fetch them from this client's payload service" in caplog.text
    x = np.array([row.features for row in out], dtype=np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).argmax(1).numpy()
    assert [row.prediction for row in out] == expected.astype(float).tolist()
    assert len(out) == len(digits().y_test)
    # the model gone, its weights are no longer served and the idle server stops
    server = served_by[0]
    del model, shipped
    gc.collect()
    assert server.stopping and server not in payload_server._SHARED.values()
