"""The trainer shared by every experiment: config -> data -> model build -> loop -> checkpoint -> log -> eval
(README.md here lists the modules)."""
