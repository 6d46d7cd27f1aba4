"""What the step-latency models cost, and the step logs they are fitted on."""
