"""Pipelined execution across stage submeshes (GPipe, 1F1B) and its displays."""
from .display import schedule_chart, stages_table
from .executor import PipelineTrainer
from .schedules import Action, GPipe, OneFOneB, Schedule, get_schedule, simulate

__all__ = ["Action", "GPipe", "OneFOneB", "PipelineTrainer", "Schedule", "get_schedule", "schedule_chart",
           "simulate", "stages_table"]
