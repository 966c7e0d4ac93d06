"""What follows from the plan alone, derived once and read by cost, memory and replay: the pipeline
schedule's per-rank action lists (schedules.py, schedules_zb.py), the layer mix of each stage
(layer_mix.py), and the split of a traced backward into input- and weight-gradient parts
(backward_split.py). It sits above specs/ and trace/ and below cost/ (DESIGN.md's floors)."""
