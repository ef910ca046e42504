"""register_tasks refuses a Celery app that serialises with or accepts pickle."""

from __future__ import annotations

import pytest
from celery import Celery

from tokenmill.producer.celery import JSON_ONLY, register_tasks


@pytest.mark.parametrize("setting", [
    {"accept_content": ["json", "pickle"]},
    {"accept_content": ["application/x-python-serialize"]},
    {"result_accept_content": ["pickle"]},
    {"task_serializer": "pickle"},
    {"result_serializer": "PICKLE"},
    {"event_serializer": "pickle"},
])
def test_an_app_that_accepts_pickle_is_refused(setting: dict[str, object]) -> None:
    app = Celery("pickled")
    app.conf.update(setting)
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"accepts pickle.*{name}="):
        register_tasks(app)
    assert "tokenmill.generate" not in app.tasks


@pytest.mark.parametrize("conf", [{}, JSON_ONLY])
def test_json_and_msgpack_apps_are_taken(conf: dict[str, object]) -> None:
    app = Celery("plain")
    app.conf.update(conf)
    assert register_tasks(app).name == "tokenmill.generate"
