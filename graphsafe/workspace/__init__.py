"""Shared scratch memory for real impls (never for fake impls): see manager.py."""

from graphsafe.workspace.manager import (
    ALIGNMENT,
    GROWTH_GRANULARITY,
    WorkspaceManager,
    WorkspaceStats,
    all_workspace_managers,
    current_lane,
    current_workspace_manager,
    plan_layout,
    reset_workspace_managers,
    workspace_bytes,
    workspace_lane,
)

__all__ = [
    "ALIGNMENT",
    "GROWTH_GRANULARITY",
    "WorkspaceManager",
    "WorkspaceStats",
    "all_workspace_managers",
    "current_lane",
    "current_workspace_manager",
    "plan_layout",
    "reset_workspace_managers",
    "workspace_bytes",
    "workspace_lane",
]
