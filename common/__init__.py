"""The bottom layer: configuration structs (`config`) and the wire types the gateway and the
engine share (`wire`). Imports only the standard library, msgspec and yaml."""
