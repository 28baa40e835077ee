"""prefixscore.v1 message classes. Generated from prefixscore/serve/proto/prefixscore.proto by
prefixscore.serve.proto.regenerate() (grpcio-tools 1.85.1): do not edit.

Built at import from the compiled descriptor (works on any protobuf runtime >= 4.21; see
prefixscore/serve/proto/__init__.py for why this is not protoc's own _pb2 output)."""
from google.protobuf import descriptor_pool as _descriptor_pool
from google.protobuf import message_factory as _message_factory

SERIALIZED = (
    b'\n)prefixscore/serve/proto/prefixscore.proto\x12\x0eprefixscore.v1"\xa0\x01\n\x0fClassify'
    b'Request\x12\x18\n\x07queries\x18\x01 \x03(\tR\x07queries\x12#\n\nclassifier\x18\x02 \x01('
    b'\tH\x00R\nclassifier\x88\x01\x01\x12\x19\n\x05model\x18\x03 \x01(\tH\x01R\x05model\x88'
    b'\x01\x01\x12\x1a\n\x08priority\x18\x04 \x01(\x05R\x08priorityB\r\n\x0b_classifierB\x08\n'
    b'\x06_model"\x8d\x01\n\x0eClassifyResult\x12\x14\n\x05query\x18\x01 \x01(\tR\x05query\x12'
    b'\x14\n\x05label\x18\x02 \x01(\tR\x05label\x12\x1f\n\x0blabel_index\x18\x03 \x01(\rR\nlabe'
    b'lIndex\x12\x16\n\x06scores\x18\x04 \x03(\x01R\x06scores\x12\x16\n\x06cached\x18\x05 \x01('
    b'\x08R\x06cached"~\n\x06Timing\x12\x19\n\x08queue_ms\x18\x01 \x01(\x01R\x07queueMs\x12\x1f'
    b'\n\x0btokenize_ms\x18\x02 \x01(\x01R\ntokenizeMs\x12\x1d\n\nforward_ms\x18\x03 \x01(\x01R'
    b'\tforwardMs\x12\x19\n\x08total_ms\x18\x04 \x01(\x01R\x07totalMs"\xd3\x01\n\x10ClassifyRes'
    b'ponse\x12\x16\n\x06labels\x18\x01 \x03(\tR\x06labels\x128\n\x07results\x18\x02 \x03(\x0b2'
    b'\x1e.prefixscore.v1.ClassifyResultR\x07results\x12\x1d\n\nbatch_size\x18\x03 \x01(\rR\tba'
    b'tchSize\x12.\n\x06timing\x18\x04 \x01(\x0b2\x16.prefixscore.v1.TimingR\x06timing\x12\x1e'
    b'\n\nclassifier\x18\x05 \x01(\tR\nclassifier"\x1c\n\x08TokenIds\x12\x10\n\x03ids\x18\x01 '
    b'\x03(\x03R\x03ids"\x1f\n\x05Texts\x12\x16\n\x06values\x18\x01 \x03(\tR\x06values"@\n\x0cT'
    b'okenIdLists\x120\n\x06values\x18\x01 \x03(\x0b2\x18.prefixscore.v1.TokenIdsR\x06values"{'
    b'\n\x04Item\x12\x14\n\x04text\x18\x01 \x01(\tH\x00R\x04text\x12\x1e\n\tembedding\x18\x02 '
    b'\x01(\x0cH\x00R\tembedding\x12\x10\n\x02id\x18\x03 \x01(\tH\x00R\x02id\x12\x19\n\x05dtype'
    b'\x18\x04 \x01(\tH\x01R\x05dtype\x88\x01\x01B\x06\n\x04itemB\x08\n\x06_dtype"5\n\x05Items'
    b'\x12,\n\x06values\x18\x01 \x03(\x0b2\x14.prefixscore.v1.ItemR\x06values"\xa9\x04\n\x0cSco'
    b'reRequest\x12\x1f\n\nquery_text\x18\x01 \x01(\tH\x00R\tqueryText\x127\n\tquery_ids\x18'
    b'\x02 \x01(\x0b2\x18.prefixscore.v1.TokenIdsH\x00R\x08queryIds\x126\n\nitem_texts\x18\x03 '
    b'\x01(\x0b2\x15.prefixscore.v1.TextsH\x01R\titemTexts\x129\n\x08item_ids\x18\x04 \x01(\x0b'
    b'2\x1c.prefixscore.v1.TokenIdListsH\x01R\x07itemIds\x124\n\titem_list\x18\x0c \x01(\x0b2'
    b'\x15.prefixscore.v1.ItemsH\x01R\x08itemList\x12&\n\x0flabel_token_ids\x18\x05 \x03(\x03R'
    b'\rlabelTokenIds\x12\x16\n\x06labels\x18\x06 \x03(\tR\x06labels\x12(\n\rapply_softmax\x18'
    b'\x07 \x01(\x08H\x02R\x0capplySoftmax\x88\x01\x01\x12"\n\nitem_first\x18\x08 \x01(\x08H'
    b'\x03R\titemFirst\x88\x01\x01\x12\x19\n\x05model\x18\t \x01(\tH\x04R\x05model\x88\x01\x01'
    b'\x12\x1a\n\x08priority\x18\n \x01(\x05R\x08priority\x12\x14\n\x05prior\x18\x0b \x03(\x01R'
    b'\x05priorB\x07\n\x05queryB\x07\n\x05itemsB\x10\n\x0e_apply_softmaxB\r\n\x0b_item_firstB'
    b'\x08\n\x06_model"$\n\nItemScores\x12\x16\n\x06values\x18\x01 \x03(\x01R\x06values"|\n\x05'
    b'Usage\x12#\n\rprompt_tokens\x18\x01 \x01(\x03R\x0cpromptTokens\x12+\n\x11completion_token'
    b's\x18\x02 \x01(\x03R\x10completionTokens\x12!\n\x0ctotal_tokens\x18\x03 \x01(\x03R\x0btot'
    b'alTokens"\xe4\x01\n\rScoreResponse\x122\n\x06scores\x18\x01 \x03(\x0b2\x1a.prefixscore.v1'
    b'.ItemScoresR\x06scores\x12\x16\n\x06labels\x18\x02 \x03(\tR\x06labels\x12\x14\n\x05model'
    b'\x18\x03 \x01(\tR\x05model\x12+\n\x05usage\x18\x04 \x01(\x0b2\x15.prefixscore.v1.UsageR'
    b'\x05usage\x12\x14\n\x05depth\x18\x05 \x01(\rR\x05depth\x12\x16\n\x06scored\x18\x06 \x03('
    b'\x08R\x06scored\x12\x16\n\x06cached\x18\x07 \x01(\rR\x06cached".\n\x12HealthCheckRequest'
    b'\x12\x18\n\x07service\x18\x01 \x01(\tR\x07service"\xb1\x01\n\x13HealthCheckResponse\x12I'
    b'\n\x06status\x18\x01 \x01(\x0e21.prefixscore.v1.HealthCheckResponse.ServingStatusR\x06sta'
    b'tus"O\n\rServingStatus\x12\x0b\n\x07UNKNOWN\x10\x00\x12\x0b\n\x07SERVING\x10\x01\x12\x0f'
    b'\n\x0bNOT_SERVING\x10\x02\x12\x13\n\x0fSERVICE_UNKNOWN\x10\x032\xa2\x01\n\x0bPrefixScore'
    b'\x12M\n\x08Classify\x12\x1f.prefixscore.v1.ClassifyRequest\x1a .prefixscore.v1.ClassifyRe'
    b'sponse\x12D\n\x05Score\x12\x1c.prefixscore.v1.ScoreRequest\x1a\x1d.prefixscore.v1.ScoreRe'
    b'sponseb\x06proto3'
)

_pool = _descriptor_pool.Default()
_pool.AddSerializedFile(SERIALIZED)
DESCRIPTOR = _pool.FindFileByName('prefixscore/serve/proto/prefixscore.proto')


def _message(name):
    desc = DESCRIPTOR.message_types_by_name[name]
    if hasattr(_message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return _message_factory.GetMessageClass(desc)
    return _message_factory.MessageFactory(_pool).GetPrototype(desc)


ClassifyRequest = _message('ClassifyRequest')
ClassifyResult = _message('ClassifyResult')
Timing = _message('Timing')
ClassifyResponse = _message('ClassifyResponse')
TokenIds = _message('TokenIds')
Texts = _message('Texts')
TokenIdLists = _message('TokenIdLists')
Item = _message('Item')
Items = _message('Items')
ScoreRequest = _message('ScoreRequest')
ItemScores = _message('ItemScores')
Usage = _message('Usage')
ScoreResponse = _message('ScoreResponse')
HealthCheckRequest = _message('HealthCheckRequest')
HealthCheckResponse = _message('HealthCheckResponse')
