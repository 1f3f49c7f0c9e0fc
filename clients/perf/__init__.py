"""`paddlequic perf`: a closed-loop load tester for Open Inference Protocol servers, modelled
on Triton's perf_analyzer. Client-side only (grpcio, aioquic, numpy): it never imports the
server."""
