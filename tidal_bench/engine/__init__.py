"""The torch engine alone: throughput, roofline, where a decode step goes."""
