"""The full names of the services this server serves, as health checks and reflection give them."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from protos.inference import grpc_service_pb2 as inference_pb2
from protos.paddlequic.v1 import control_pb2, testing_pb2

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
TESTING_SERVICE = testing_pb2.DESCRIPTOR.services_by_name["Testing"].full_name
