"""Settings: one group per role, together in `Settings`, each read from the same TRAINYARD_* names."""

from __future__ import annotations

from common.settings import ApiSettings, LoggingSettings, SchedulerSettings, Settings, SlurmSettings, StorageSettings, WorkerSettings

GROUPS = (StorageSettings, LoggingSettings, ApiSettings, SchedulerSettings, WorkerSettings, SlurmSettings)


def test_every_setting_belongs_to_exactly_one_role_group():
    owners = [name for group in GROUPS for name in group.model_fields]
    assert len(owners) == len(set(owners))  # no setting in two groups
    assert set(owners) == set(Settings.model_fields)  # and none outside a group


def test_a_role_group_reads_its_own_settings_from_the_environment_as_settings_does(monkeypatch):
    monkeypatch.setenv("TRAINYARD_LEASE_SECONDS", "7")
    monkeypatch.setenv("TRAINYARD_SCHEDULER_INTERVAL_SECONDS", "0.5")
    monkeypatch.setenv("TRAINYARD_SCRIPT_PACKAGES", '["torch"]')
    assert WorkerSettings().lease_seconds == Settings().lease_seconds == 7
    assert SchedulerSettings().scheduler_interval_seconds == Settings().scheduler_interval_seconds == 0.5
    assert ApiSettings().script_packages == Settings().script_packages == ["torch"]


def test_each_place_is_under_the_data_dir_unless_set(tmp_path):
    settings = Settings(data_dir=tmp_path, data_root=tmp_path / "elsewhere")
    assert settings.resolved_database_url == f"sqlite:///{tmp_path.resolve()}/trainyard.db"
    assert settings.resolved_broker_url == f"sqla+sqlite:///{tmp_path.resolve()}/broker.db"
    assert settings.resolved_artifact_root == tmp_path.resolve() / "artifacts"
    assert settings.resolved_data_root == tmp_path.resolve() / "elsewhere"
    assert settings.resolved_work_root == tmp_path.resolve() / "work"
    assert settings.resolved_plugin_dir == tmp_path.resolve() / "plugins"
    assert settings.resolved_code_root == tmp_path.resolve() / "code"
