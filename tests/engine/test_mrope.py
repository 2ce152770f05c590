"""M-RoPE positions (engine/multimodal/mrope.py) against transformers' own Qwen2-VL `get_rope_index`, per prefill
chunk and decode step, and prompts whose image tokens do not match their grids."""
import pytest

torch = pytest.importorskip("torch")

from engine.batch import SeqSpan  # noqa: E402
from engine.multimodal.mrope import prompt_positions, step_positions  # noqa: E402
from engine.multimodal.prompt import MultiModalPrompt  # noqa: E402

IMAGE = 9
GRIDS = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 2, 2]])  # patches; 2 x 2 patches per token: 6, 8 and 1 tokens
PROMPT = [IMAGE] * 6 + [3, 4] + [IMAGE] * 8 + [IMAGE] + [5, 6, 7]  # an image first, two images side by side


def transformers_positions(ids, grids):
    from transformers import Qwen2VLConfig, Qwen2VLModel

    text = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, vocab_size=16,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]))
    vision = dict(depth=1, embed_dim=8, hidden_size=8, num_heads=1, mlp_ratio=1, patch_size=2)
    model = Qwen2VLModel(Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE))
    input_ids = torch.tensor([ids])
    positions, delta = model.get_rope_index(input_ids, (input_ids == IMAGE).int(), grids)
    return positions[:, 0], int(delta)


def test_prompt_positions_equal_transformers():
    ids = PROMPT[:16] + [5, 6, 7]  # the first two images only (transformers merges touching images into one run)
    positions, delta = prompt_positions(ids, IMAGE, GRIDS[:2], merge_size=2)
    expected, expected_delta = transformers_positions(ids, GRIDS[:2])
    assert torch.equal(positions, expected) and delta == expected_delta
    assert positions[:, :6].tolist() == [[0] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]  # rows x columns
    assert delta == int(positions.max()) + 1 - len(ids) < 0


def test_touching_images_are_told_apart_by_their_grids():
    positions, delta = prompt_positions(PROMPT, IMAGE, GRIDS, merge_size=2)
    assert positions[:, 16].tolist() == [int(positions[1, 15]) + 1] * 3 == [int(positions[1, 8]) + 4] * 3  # 4 rows on
    assert positions[:, -1].tolist() == [len(PROMPT) - 1 + delta] * 3


def test_step_positions_per_chunk_and_decode_match_the_whole_prompt():
    positions, delta = prompt_positions(PROMPT, IMAGE, GRIDS, merge_size=2)
    images = MultiModalPrompt({}, [i for i, t in enumerate(PROMPT) if t == IMAGE], [], 3, rope_positions=positions,
                              rope_delta=delta)
    chunks = [(0, 4), (4, 11), (11, len(PROMPT))]  # chunk ends inside the first and the second image
    got = [step_positions([SeqSpan(1, PROMPT[a:b], a, [], images=images, rope_delta=delta)], torch.arange(a, b))
           for a, b in chunks]
    assert torch.equal(torch.cat(got, 1), positions)
    decode = SeqSpan(1, [5], len(PROMPT), [], rope_delta=delta)       # no images left: the delta alone
    text = SeqSpan(2, [1, 2, 3], 0, [])                               # a text-only request beside it
    flat = torch.tensor([len(PROMPT), 0, 1, 2])
    assert step_positions([decode, text], flat).tolist() == [[len(PROMPT) + delta, 0, 1, 2]] * 3
    text_only = flat[1:]
    assert step_positions([text], text_only) is text_only  # no M-RoPE in the step: the flat positions as they are


@pytest.mark.parametrize("ids, grids", [
    ([1, IMAGE, IMAGE, 2], GRIDS[:1]),                  # fewer image tokens than the grid's 6
    ([1] + [IMAGE] * 6 + [2], GRIDS[:2]),               # a second grid with no image tokens left
    ([IMAGE] * 5 + [1] + [IMAGE] + [2], GRIDS[:1]),     # the run breaks inside the image
])
def test_image_tokens_that_do_not_match_their_grids_are_refused(ids, grids):
    with pytest.raises(ValueError, match="image"):
        prompt_positions(ids, IMAGE, grids, merge_size=2)


def test_models_whose_mrope_rules_the_engine_does_not_follow_are_refused():
    import transformers

    from engine.models.transformers_backend import unsupported_reason

    assert unsupported_reason(transformers.Qwen2VLConfig()) is None
    assert "M-RoPE" in unsupported_reason(transformers.Glm4vConfig())
