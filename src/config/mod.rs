//! Configuration: placeholder until the config module lands.
