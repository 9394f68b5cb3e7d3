"""The wire: what crosses a process boundary, the bottom of the house.

`protocol` (the messages, column names and metadata keys ranks and the service exchange),
`schema` (the batch schema and how a step's rows become one Arrow batch), `layout` (a step's
compact and full layouts, a step file), `arrays` (Arrow arrays and IPC bytes). `pipeline/`,
`service/` and `trainer/` all import it; it imports nothing of tokenmill, so a trainer reads
batches without the data plane installed.
"""
