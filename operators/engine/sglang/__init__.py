"""SGLang servers behind the `InferenceEngine` interface: `adapter.py` (SGLangEngine), `weights.py`
(pushing versions in), `sender.py` (the same push from the trainer's side), `launch.py` (starting
servers), `image_data.py` (images on `/generate`)."""
