"""Runtime services a training process needs beside the math: the device, the watchdog over peers, and the
graceful stop on SIGTERM/SIGINT."""
