"""Model parallelism: pipeline stages across barrier tasks, and hybrid data x pipeline.

- :mod:`partition` splits an ``nn.Sequential`` into P balanced, consecutive stages;
- :mod:`schedule` orders each stage's micro-batch work (GPipe, 1F1B);
- :mod:`group` runs ring allreduces over a sub-group of a mesh (the D replicas of a stage);
- :mod:`stage` is the loop every stage task runs (executor side, no Spark);
- :mod:`pipeline` is the driver side: plan, launch, reassemble the model.
"""
