"""Job spec and API models shared by the service, workers and clients. Imports nothing of the project."""

from api_schemas.api import (
    AttemptOut,
    AttemptStatus,
    CheckpointOut,
    DashboardOut,
    JobOut,
    JobPage,
    JobStatus,
    LogLineOut,
    LogsOut,
    MetricSeries,
    MetricsOut,
    RunningJobOut,
    UserCreated,
    WorkerOut,
)
from api_schemas.jobs import (
    CheckpointConfig,
    DatasetConfig,
    JobSpec,
    ModelConfig,
    OptimizerConfig,
    ResourcesConfig,
    ScheduleConfig,
    TrainingConfig,
)

__all__ = [name for name in dir() if name[0].isupper()]
