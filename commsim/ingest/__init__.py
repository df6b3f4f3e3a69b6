"""Reading real runs' own records into commsim's trace schema: torch.profiler traces
(``profiler``), torch.distributed Flight Recorder dumps (``flight_recorder``) and
DeepSpeed's comms-logger output (``comms_logger``); ``detect`` tells them apart by
content, and ``load`` turns a path into a trace or a collective sequence. None of it
needs torch."""
